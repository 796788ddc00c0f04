"""The transformers backend with the real SmolLM2-135M-Instruct (one load per module)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from opsd.chat import ChatFormat
from opsd.config import ModelSection
from opsd.models import Generation, NonFiniteLogitsError, load_backend, token_logprobs
from opsd.models import hf, packaged
from opsd.models.hf import HFBackend

MAX_LEN = 256


@pytest.fixture(scope="module")
def backend():
    # One thread: the 2 cores are shared with other processes, and 2 spinning
    # OpenMP threads under contention ran 25x slower here (see report).
    threads = torch.get_num_threads()
    yield load_backend(ModelSection(max_model_len=MAX_LEN, threads=1))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    fmt = ChatFormat(backend.tokenizer, "action")
    sys_msg = "You play a text game. Reply with one command inside <action></action>."
    return [
        fmt.initial_prompt_ids(sys_msg, "You are in a kitchen. There is a closed fridge."),
        fmt.initial_prompt_ids(sys_msg, "You are in a dark hall. Exits: north, east, west. A key lies here."),
    ]


def test_case6_temperature_logprob_arithmetic():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp = token_logprobs(logits, torch.tensor(0), temperature=0.5).item()
    assert lp == pytest.approx(-0.1429, abs=1e-4)  # log_softmax([4, 2, 0])[0]
    assert lp == pytest.approx(-math.log(1 + math.exp(-2) + math.exp(-4)), abs=1e-6)
    # Neither "no temperature" (-0.4076) nor "raw log-prob / T" (-0.8152).
    assert token_logprobs(logits, torch.tensor(0), 1.0).item() == pytest.approx(-0.4076, abs=1e-4)
    with pytest.raises(ValueError):
        token_logprobs(logits, torch.tensor(0), 0.0)


@pytest.mark.parametrize("T", [0.25, 0.5, 0.7, 1.0, 1.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_case6_logprob_convention_for_every_temperature_and_dtype(T, dtype):
    # The kind: log softmax(z / T)[y] in float32, whatever T and whatever dtype the logits come in.
    g = torch.Generator().manual_seed(int(T * 100))
    logits = (torch.randn(4, 7, 50, generator=g) * 3).to(dtype)
    ids = torch.randint(0, 50, (4, 7), generator=g)
    lp = token_logprobs(logits, ids, T)
    z = logits.double() / T
    want = (z.gather(-1, ids[..., None])[..., 0] - torch.logsumexp(z, -1)).float()
    assert lp.dtype == torch.float32 and torch.allclose(lp, want, atol=2e-6, rtol=1e-6)
    if T != 1.0:  # the two wrong conventions of case 6 are really different numbers
        plain = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0].float()
        assert (lp - plain).abs().max() > 1e-2 and (lp - plain / T).abs().max() > 1e-2


def test_case6_sampler_and_trainer_agree_and_the_metric_exports_it(backend, prompts):
    """The sampler's log-probs at T are what the trainer recomputes at T: the first epoch's ratio is 1
    and `sampler_logprob_mismatch` is ~0; the trainer at another T shows up in that metric."""
    from opsd.config import TrainerSection
    from services.trainer.update import Sequence, ppo_update

    T = 0.5
    gens = backend.generate(prompts, max_new_tokens=8, temperature=T, seed=3)
    seqs = []
    for p, g in zip(prompts, gens):
        n = len(p) + len(g.token_ids)
        mask = np.zeros(n, np.uint8)
        mask[len(p) :] = 1
        sampler = np.zeros(n, np.float32)
        sampler[len(p) :] = g.logprobs
        seqs.append(Sequence(np.asarray(p + g.token_ids, np.int32), mask, mask.astype(np.float32), sampler))
    before = backend.model.model.norm.weight.detach().clone()
    opt = torch.optim.SGD(backend.model.parameters(), lr=0.0)  # the metrics only: the shared weights stay
    cfg = TrainerSection(ppo_epochs=1, micro_batch_size=2, entropy_coef=0.0)
    try:
        same = ppo_update(backend.model, opt, seqs, cfg, temperature=T)
        other = ppo_update(backend.model, opt, seqs, cfg, temperature=1.0)
    finally:
        backend.model.zero_grad(set_to_none=True)
    assert torch.equal(before, backend.model.model.norm.weight)
    assert same["ratio_dev_max"] == 0.0 and same["sampler_logprob_mismatch"] < 1e-4
    assert other["sampler_logprob_mismatch"] > 0.05


def test_backend_attributes(backend):
    assert backend.eos_token_id == backend.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert backend.vocab_size == 49152
    assert isinstance(backend, HFBackend) and backend.policy_version == 0
    assert next(backend.model.parameters()).dtype == torch.float32


def test_generate_logprobs_equal_score(backend, prompts):
    t0 = time.perf_counter()
    gens = backend.generate(prompts, max_new_tokens=8, temperature=0.8, seed=0)
    elapsed = time.perf_counter() - t0
    assert len(gens) == 2 and all(isinstance(g, Generation) for g in gens)
    for g in gens:
        assert 1 <= len(g.token_ids) == len(g.logprobs) <= 8
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == backend.eos_token_id and backend.eos_token_id not in g.token_ids[:-1]
        else:
            assert len(g.token_ids) == 8 and backend.eos_token_id not in g.token_ids
        assert all(lp <= 0 and math.isfinite(lp) for lp in g.logprobs)
    # Same seed, same draw; the global RNG is untouched by a seeded call.
    state = torch.get_rng_state()
    again = backend.generate(prompts, max_new_tokens=8, temperature=0.8, seed=0)
    assert torch.equal(state, torch.get_rng_state())
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]

    scored = backend.score([p + g.token_ids for p, g in zip(prompts, gens)], [len(p) for p in prompts], temperature=0.8)
    for g, s in zip(gens, scored):
        assert s.dtype == np.float32 and s.shape == (len(g.token_ids),)
        np.testing.assert_allclose(s, np.array(g.logprobs, dtype=np.float32), atol=1e-4, rtol=0)
    # At another temperature the values differ: the convention is really applied.
    other = backend.score([prompts[0] + gens[0].token_ids], [len(prompts[0])], temperature=1.0)[0]
    assert np.abs(other - scored[0]).max() > 1e-3
    print(f"generate 2x8 tokens: {elapsed:.2f} s")


def test_finish_reason_comes_from_the_sampler(backend, prompts):
    # Any id stops: the first sampled id ends the turn although it is not <|im_end|> (case 16).
    g = backend.generate(prompts[:1], 4, 1.0, seed=1, stop_token_ids=range(backend.vocab_size))[0]
    assert g.finish_reason == "stop" and len(g.token_ids) == 1
    s = backend.score([prompts[0] + g.token_ids], [len(prompts[0])])[0]
    assert abs(s[0] - g.logprobs[0]) < 1e-4
    # top_p keeps at least one token even when tiny.
    g = backend.generate(prompts[:1], 2, 1.0, top_p=1e-6, seed=1)[0]
    assert 1 <= len(g.token_ids) <= 2


def test_score_exact_ids_and_batch_padding(backend, prompts):
    tok = backend.tokenizer
    he_llo = [255, 31394]  # "he" + "llo": not the canonical encoding of "hello" (28120)
    seqs = [
        prompts[0] + he_llo + [2],
        prompts[1] + tok("go north</action>", add_special_tokens=False)["input_ids"] + [2],
        prompts[0][:20],
    ]
    starts = [len(prompts[0]), len(prompts[1]), 5]
    batched = backend.score(seqs, starts, batch_size=3)
    single = [backend.score([s], [st], batch_size=1)[0] for s, st in zip(seqs, starts)]
    for b, s, seq, st in zip(batched, single, seqs, starts):
        assert b.shape == (len(seq) - st,)
        # fp32 matmuls of another shape sum in another order: the project's
        # tolerance 1e-5 * max(1, |x|) (observed max difference 1.2e-5 at |x| = 7.5).
        np.testing.assert_allclose(b, s, atol=1e-5, rtol=1e-5)
    # Independent check of the indexing: one unpadded forward, logits at t-1 predict token t.
    with torch.no_grad():
        logits = backend.model(torch.tensor([seqs[0]])).logits[0]
    ids = torch.tensor(seqs[0])
    manual = token_logprobs(logits[starts[0] - 1 : -1], ids[starts[0] :]).numpy()
    np.testing.assert_allclose(batched[0], manual, atol=1e-5, rtol=1e-5)
    # Edge cases: nothing to score, and a start with no prefix.
    assert backend.score([seqs[2]], [len(seqs[2])])[0].shape == (0,)
    with pytest.raises(ValueError):
        backend.score([seqs[2]], [0])
    with pytest.raises(ValueError):
        backend.score([[1, backend.vocab_size]], [1])


def test_too_long_prompt_raises(backend, prompts):
    long_prompt = (prompts[0] * 10)[: MAX_LEN - 4]
    assert not backend.fits(len(long_prompt), 8) and backend.fits(len(long_prompt), 4)
    with pytest.raises(ValueError, match="max_model_len"):
        backend.generate([prompts[1], long_prompt], max_new_tokens=8, temperature=1.0)
    with pytest.raises(ValueError):
        backend.generate([[]], max_new_tokens=1, temperature=1.0)
    with pytest.raises(ValueError):
        backend.generate([prompts[0]], max_new_tokens=0, temperature=1.0)


def test_nonfinite_logprobs_are_never_silent(backend, prompts):
    w = backend.model.lm_head.weight  # tied with the input embedding
    saved = w[100].clone()
    try:
        with torch.no_grad():
            w[100] = float("nan")
        seq = prompts[0] + [44, 4667]
        with pytest.raises(NonFiniteLogitsError) as err:
            backend.score([prompts[1], seq], [len(prompts[1]) - 3, len(prompts[0])])
        assert err.value.rows == [0, 1]
        lenient = backend.score([seq], [len(prompts[0])], strict=False)[0]
        assert lenient.shape == (2,) and np.isnan(lenient).all()
        with pytest.raises(NonFiniteLogitsError):
            backend.generate(prompts[:1], 2, 1.0, seed=0)
    finally:
        with torch.no_grad():
            w[100] = saved
    assert np.isfinite(backend.score([prompts[0] + [44]], [len(prompts[0])])[0]).all()


def test_save_load_weights_round_trip(backend, prompts, tmp_path):
    seq, start = prompts[0] + [44, 4667, 46], len(prompts[0])
    before = backend.score([seq], [start])[0]
    path = tmp_path / "policy" / "v1.safetensors"
    backend.save_weights(path)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["v1.safetensors"]  # no temp left
    try:
        with torch.no_grad():
            backend.model.model.norm.weight.mul_(1.5)
        assert np.abs(backend.score([seq], [start])[0] - before).max() > 1e-3
        backend.load_weights(path, version=1)
        assert backend.policy_version == 1
        np.testing.assert_array_equal(backend.score([seq], [start])[0], before)
        # The embedding / LM head tie survives the round trip.
        assert backend.model.lm_head.weight.data_ptr() == backend.model.model.embed_tokens.weight.data_ptr()
        # A wrong file is rejected before any weight changes.
        bad = tmp_path / "bad.safetensors"
        save_file({"model.norm.weight": torch.zeros(3)}, str(bad))
        with pytest.raises(KeyError, match="missing"):
            backend.load_weights(bad, version=2)
        assert backend.policy_version == 1
        np.testing.assert_array_equal(backend.score([seq], [start])[0], before)
    finally:
        backend.load_weights(path, version=0)  # leave the shared module fixture as it was


def test_ensure_model_converts_once_under_concurrency(tmp_path, monkeypatch):
    calls = []

    def fake_convert(package, filename, out_dir):
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the other callers to hit the lock
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(packaged, "_convert_gguf", fake_convert)
    cfg = ModelSection(cache_dir=str(tmp_path))
    stale = tmp_path / "models" / ".tmp-smollm2-135m-instruct-dead"
    stale.mkdir(parents=True)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(hf.ensure_model(cfg))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "models" / "smollm2-135m-instruct"
    assert len(calls) == 1 and results == [target] * 4
    assert (target / "config.json").is_file() and not stale.exists()
    # A local HF directory is used as is; anything else is an error.
    assert hf.ensure_model(ModelSection(name=str(target))) == target
    with pytest.raises(FileNotFoundError):
        hf.ensure_model(ModelSection(name=str(tmp_path / "nope")))


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    def broken(package, filename, out_dir):
        (Path(out_dir) / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(packaged, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        hf.ensure_model(ModelSection(cache_dir=str(tmp_path)))
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".smollm2-135m-instruct.lock"]


# ---------------------------------------------------------------------------
# branch: one KV cache per base sequence (prefix reuse)


@pytest.fixture(scope="module")
def branch_base(backend, prompts) -> list[int]:
    """A two-turn chat (~150 tokens) whose turn prompts are prefixes of it."""
    tok = backend.tokenizer
    reply = tok("<action>open fridge</action>", add_special_tokens=False)["input_ids"] + [backend.eos_token_id]
    obs = tok("\nYou open the fridge. Inside: milk, eggs and a carrot. Exits: north.", add_special_tokens=False)
    base = prompts[0] + reply + obs["input_ids"] + prompts[1][-12:]
    assert len(base) + 8 <= MAX_LEN
    return base


def test_branch_matches_score(backend, branch_base):
    base, start = branch_base, 10
    L = len(base)
    cuts = [60, 21, L, 45]  # unsorted; L = the whole base
    conts = [
        [base[60:80], [44, 4667, 46]],
        [[9]],
        [[44, 4667], [], base[5:25]],
        [base[45:66]],
    ]
    t0 = time.perf_counter()
    res = backend.branch(base, start, cuts, conts, score_temperature=0.7)
    elapsed = time.perf_counter() - t0
    ref = backend.score([base], [start], temperature=0.7)[0]
    assert res.base_logprobs.dtype == np.float32 and res.base_logprobs.shape == (L - start,)
    np.testing.assert_allclose(res.base_logprobs, ref, atol=1e-5, rtol=0)
    assert res.generations == [None] * 4
    assert [len(c) for c in res.continuation_logprobs] == [2, 1, 3, 1]
    for i, c in enumerate(cuts):
        for j, cont in enumerate(conts[i]):
            got = res.continuation_logprobs[i][j]
            assert got.dtype == np.float32 and got.shape == (len(cont),)
            want = backend.score([base[:c] + cont], [c], temperature=0.7)[0]
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"cut {i} continuation {j}")
    # Batch-1 rows (one per forward) give the same numbers as the batched rows.
    saved = backend.branch_batch_tokens
    try:
        backend.branch_batch_tokens = 1
        single = backend.branch(base, start, cuts, conts, score_temperature=0.7)
    finally:
        backend.branch_batch_tokens = saved
    for a, b in zip(single.continuation_logprobs, res.continuation_logprobs):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
    # start == len(base): nothing of the base is scored; only base[:max(cuts)] is run.
    tail = backend.branch(base, L, [21], [[base[21:30]]])
    assert tail.base_logprobs.shape == (0,)
    np.testing.assert_allclose(tail.continuation_logprobs[0][0], backend.score([base[:30]], [21])[0], atol=1e-4, rtol=0)
    print(f"branch: {L} tokens, 4 cuts, 7 continuations: {elapsed:.2f} s")


def test_branch_generation_is_a_seeded_sample(backend, branch_base):
    base = branch_base
    cuts = [len(base), 40]
    state = torch.get_rng_state()
    res = backend.branch(base, 1, cuts, generate_tokens=8, temperature=0.8, seed=5)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is untouched
    assert res.continuation_logprobs == [[], []]
    for c, g in zip(cuts, res.generations):
        assert isinstance(g, Generation) and 1 <= len(g.token_ids) == len(g.logprobs) <= 8
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == backend.eos_token_id and backend.eos_token_id not in g.token_ids[:-1]
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == 8
            assert backend.eos_token_id not in g.token_ids
        want = backend.score([base[:c] + g.token_ids], [c], temperature=0.8)[0]
        np.testing.assert_allclose(np.array(g.logprobs, dtype=np.float32), want, atol=1e-4, rtol=0)
    again = backend.branch(base, 1, cuts, generate_tokens=8, temperature=0.8, seed=5)
    assert [g and (g.token_ids, g.logprobs) for g in again.generations] == [
        g and (g.token_ids, g.logprobs) for g in res.generations
    ]
    # Drawn as `generate` draws the same prompts with the same seed (same sampler and stream).
    gens = backend.generate([base[:c] for c in cuts], 8, 0.8, seed=5)
    assert [g.token_ids for g in gens] == [g.token_ids for g in res.generations]
    # A cut with no budget (cut + generate_tokens > max_model_len) gets None, not an error.
    budget = MAX_LEN - len(base) + 1
    assert not backend.fits(len(base), budget) and backend.fits(len(base), budget - 1)
    none = backend.branch(base, len(base), [len(base)], [[[44]]], generate_tokens=budget, seed=0)
    assert none.generations == [None] and none.continuation_logprobs[0][0].shape == (1,)


def test_branch_errors(backend, branch_base):
    base = branch_base
    L = len(base)
    for bad_cut in (0, L + 1, -3):
        with pytest.raises(ValueError, match="cut 1"):
            backend.branch(base, 1, [5, bad_cut])
    with pytest.raises(ValueError, match=r"cut 1 \(at 20\)"):
        backend.branch(base, 1, [10, 20], [[[5]], [[5] * (backend.max_positions - 19)]])
    with pytest.raises(ValueError):
        backend.branch(base, 1, [10], [[[backend.vocab_size]]])
    with pytest.raises(ValueError):
        backend.branch(base, 1, [10, 20], [[[5]]])  # one continuation list per cut
    with pytest.raises(ValueError):
        backend.branch(base, 0, [10])
    with pytest.raises(ValueError):
        backend.branch([], 1, [])
    with pytest.raises(ValueError):
        backend.branch(base, 1, [10], generate_tokens=2, temperature=0.0)


def test_branch_nonfinite_is_never_silent(backend, branch_base):
    w = backend.model.lm_head.weight
    saved = w[100].clone()
    try:
        with torch.no_grad():
            w[100] = float("nan")
        with pytest.raises(NonFiniteLogitsError) as err:
            backend.branch(branch_base, len(branch_base), [30, 50], [[], [[44, 4667]]])
        assert err.value.rows == [1]
        with pytest.raises(NonFiniteLogitsError):
            backend.branch(branch_base, 5, [30])
    finally:
        with torch.no_grad():
            w[100] = saved


def _full_forward_logits(backend, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), V] logits of one plain forward (no cache, no batching)."""
    with torch.no_grad():
        return backend.model(input_ids=torch.tensor([ids])).logits[0].float()


def test_generate_entropies_are_those_of_the_sampling_distribution(backend, prompts):
    from opsd.credit.policy_loss import entropy_from_logits

    log_v = math.log(backend.vocab_size)
    gens = backend.generate(prompts, max_new_tokens=6, temperature=0.8, seed=2)
    for p, g in zip(prompts, gens):
        assert g.entropies is not None and len(g.entropies) == len(g.token_ids)
        assert all(0.0 <= h <= log_v for h in g.entropies)
        # Position j's distribution (temperature 0.8, no top-p) recomputed from a plain forward.
        logits = _full_forward_logits(backend, p + g.token_ids[:-1])
        want = entropy_from_logits(logits[len(p) - 1 :], 0.8).numpy()
        np.testing.assert_allclose(np.float32(g.entropies), want, atol=1e-4, rtol=0)
    # With top-p the sampled-from distribution is the renormalized nucleus: lower entropy.
    g = backend.generate(prompts[:1], max_new_tokens=4, temperature=1.0, top_p=0.5, seed=2)[0]
    p = prompts[0]
    logits = _full_forward_logits(backend, p + g.token_ids[:-1])[len(p) - 1 :]
    probs = torch.softmax(logits, -1).double()
    full = entropy_from_logits(logits, 1.0).numpy()
    for j, h in enumerate(g.entropies):
        sp, _ = probs[j].sort(descending=True)
        q = sp[(sp.cumsum(0) - sp) < 0.5]
        q = q / q.sum()
        assert h == pytest.approx(float(-(q * q.log()).sum()), abs=1e-4)
        assert 0.0 <= h <= full[j] + 1e-5
    # top_p tiny: one token left, a point mass of entropy 0. In float32 it is log(Z) - q log p with
    # q = 1 - O(2^-24): a few float32 ulps of the logits' size (~1e-7 per unit logit), hence 1e-5.
    g = backend.generate(prompts[:1], 2, 1.0, top_p=1e-6, seed=1)[0]
    assert len(g.entropies) == len(g.token_ids) == 2
    assert all(0.0 <= h < 1e-5 for h in g.entropies), g.entropies


def test_branch_entropies_equal_a_plain_forward(backend, branch_base):
    from opsd.credit.policy_loss import entropy_from_logits

    base, start = branch_base, 10
    res = backend.branch(base, start, [40], generate_tokens=3, temperature=0.8, seed=1, return_entropy=True)
    assert res.base_entropies.dtype == np.float32 and res.base_entropies.shape == (len(base) - start,)
    want = entropy_from_logits(_full_forward_logits(backend, base)[start - 1 : -1], 1.0).numpy()
    np.testing.assert_allclose(res.base_entropies, want, atol=1e-4, rtol=0)
    assert (res.base_entropies >= 0).all() and (res.base_entropies <= math.log(backend.vocab_size)).all()
    # The generations report theirs too (temperature 0.8).
    g = res.generations[0]
    assert g.entropies is not None and len(g.entropies) == len(g.token_ids)
    # Several entropy chunks give the same numbers; off by default; none at start == len(base).
    saved = HFBackend._ENTROPY_ROWS
    try:
        HFBackend._ENTROPY_ROWS = 7
        chunked = backend.branch(base, start, [], return_entropy=True)
    finally:
        HFBackend._ENTROPY_ROWS = saved
    np.testing.assert_allclose(chunked.base_entropies, res.base_entropies, atol=1e-6, rtol=0)
    assert backend.branch(base, start, []).base_entropies is None
    assert backend.branch(base, len(base), [5], return_entropy=True).base_entropies.shape == (0,)
