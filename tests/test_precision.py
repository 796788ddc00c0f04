"""Weights in their dtype (bf16 on workers, fp32 master in the trainer) and gradient checkpointing, on the packaged
tiny-random model (a real 2-layer Llama with SmolLM2's tokenizer and a tied head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from opsd.config import LoRASection, ModelSection, RunConfig, TrainerSection, config_hash, hashed_config
from opsd.models import load_backend, served_dtype
from opsd.weights import DIGEST_KEY, tensor_digest
from services.trainer.ema import PolicyEMA
from services.trainer.update import enable_gradient_checkpointing, ppo_update
from tests.factories import ppo_sequences

BF16 = ModelSection(name="tiny-random", dtype="bfloat16", device="cpu")
FP32 = ModelSection(name="tiny-random", device="cpu")


def dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_workers_hold_the_served_dtype_and_the_trainer_fp32_master_weights():
    server, trainer = load_backend(BF16), load_backend(BF16, backend="hf", weights_dtype=torch.float32)
    assert dtypes(server.model) == {torch.bfloat16} and server.weights_dtype == torch.bfloat16
    assert dtypes(trainer.model) == {torch.float32}
    assert dtypes(load_backend(FP32).model) == {torch.float32}
    assert served_dtype(BF16) == torch.bfloat16 and served_dtype(FP32) == torch.float32
    # The same weights: the server's are the trainer's rounded to bf16 (the files are fp32).
    for (name, a), b in zip(server.model.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    # Both score under bf16 autocast: finite, close (the random model's log-probs are ~ -10.8), not equal.
    seq = server.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    lp_s, lp_t = server.score([seq], [1])[0], trainer.score([seq], [1])[0]
    assert np.isfinite(lp_s).all() and 0 < np.abs(lp_s - lp_t).max() < 0.1


def test_an_integer_weights_dtype_is_refused():
    with pytest.raises(ValueError, match="floating dtype"):
        load_backend(FP32, weights_dtype=torch.int64)


def test_trainer_publishes_bf16_files_that_a_bf16_worker_loads(tmp_path):
    trainer = load_backend(BF16, backend="hf", weights_dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1e-3)  # a trained version: not what the worker loaded
    trainer.policy_version = 3
    path = tmp_path / "policy-v00003.safetensors"
    trainer.save_weights(path, dtype=served_dtype(BF16))
    loaded = load_file(str(path))
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert len(loaded) == len(trainer.model.state_dict()) - 1  # the tied head stored once
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta[DIGEST_KEY] == tensor_digest(loaded) and meta["policy_version"] == "3"

    worker = load_backend(BF16)
    worker.load_weights(path, 3)
    own = trainer.model.state_dict()
    for name, w in worker.model.state_dict().items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, own[name].to(torch.bfloat16)), name
    head, emb = worker.model.get_output_embeddings().weight, worker.model.get_input_embeddings().weight
    assert head.data_ptr() == emb.data_ptr()  # the tie survives
    # The master weights themselves (fp32) are refused by a bf16 worker, which is then unchanged.
    fp32_path = tmp_path / "fp32.safetensors"
    trainer.save_weights(fp32_path)
    with pytest.raises(ValueError, match="dtype differs"):
        worker.load_weights(fp32_path, 4)
    assert worker.policy_version == 3


def test_ema_publishes_the_served_dtype_and_checkpoints_fp32(tmp_path):
    trainer = load_backend(BF16, backend="hf", weights_dtype=torch.float32)
    ema = PolicyEMA(trainer.model, 0.5)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1e-3)
    ema.update(trainer.model)
    ema.save(tmp_path / "ema-v00001.safetensors", 1, dtype=torch.bfloat16)
    ema.save(tmp_path / "ema.safetensors", 1)  # the checkpoint's copy
    assert {t.dtype for t in load_file(str(tmp_path / "ema-v00001.safetensors")).values()} == {torch.bfloat16}
    teacher = load_backend(BF16)
    teacher.load_weights(tmp_path / "ema-v00001.safetensors", 1)
    resumed = PolicyEMA(load_backend(BF16, backend="hf", weights_dtype=torch.float32).model, 0.5)
    resumed.load(tmp_path / "ema.safetensors")
    for (name, a), b in zip(resumed.model.state_dict().items(), ema.model.state_dict().values()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name  # exact: the average goes on unchanged


def _updated(gradient_checkpointing: bool, lora: bool, dtype: str) -> tuple[dict, dict[str, torch.Tensor]]:
    backend = load_backend(FP32, backend="hf", weights_dtype=torch.float32)
    model = backend.model
    if lora:
        from opsd.lora import apply_lora

        torch.manual_seed(0)  # peft's A init draws from the global RNG
        apply_lora(model, LoRASection(r=4, alpha=8.0))
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    calls = []  # forwards of the first layer's MLP: checkpointing runs it again in the backward pass
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda *a, _f=mlp.forward, **k: calls.append(1) or _f(*a, **k)  # module hooks skip the recompute
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    m = ppo_update(model, opt, ppo_sequences(0.7, True), TrainerSection(micro_batch_size=2, entropy_coef=0.01), dtype=dtype)
    assert len(calls) == (4 if gradient_checkpointing else 2)  # 2 micro-batches
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_makes_the_same_update(lora):
    ref_m, ref_w = _updated(False, lora, "float32")
    gc_m, gc_w = _updated(True, lora, "float32")
    before = load_backend(FP32, backend="hf", weights_dtype=torch.float32).model.state_dict()
    assert ref_m["loss"] != 0.0 and gc_m["grad_norm"] > 0
    assert gc_m["loss"] == pytest.approx(ref_m["loss"], rel=1e-5, abs=1e-7)
    assert gc_m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4)
    for name, w in ref_w.items():
        assert torch.allclose(gc_w[name], w, atol=1e-6, rtol=0), name
    if lora:  # B starts at 0: a nonzero B was trained, through the checkpointed layers
        assert all(bool(w.abs().sum() > 0) for n, w in gc_w.items() if n.endswith("lora_B.default.weight"))
    else:
        assert all(not torch.equal(before[n], gc_w[n]) for n in before)


def test_gradient_checkpointing_under_bf16_autocast_keeps_fp32_master_weights():
    m, w = _updated(True, False, "bfloat16")
    ref_m, _ = _updated(False, False, "bfloat16")
    assert {t.dtype for t in w.values() if t.is_floating_point()} == {torch.float32}
    assert np.isfinite(m["loss"]) and m["loss"] == pytest.approx(ref_m["loss"], rel=1e-3)


def test_gradient_checkpointing_does_not_change_the_run_identity():
    on = RunConfig.model_validate({"trainer": {"gradient_checkpointing": True}})
    assert config_hash(hashed_config(on)) == config_hash(hashed_config(RunConfig()))
    assert config_hash(hashed_config(RunConfig.model_validate({"model": {"dtype": "bfloat16"}}))) != \
        config_hash(hashed_config(RunConfig()))


def test_precision_benchmark_quick(tmp_path):
    from tests.test_benchmarks import check_report, run_benchmark

    rows = check_report(run_benchmark("precision.py", tmp_path / "p.json", "--quick"), "precision")
    kl = {name.split(": ", 1)[1]: r["value"] for name, r in rows.items() if name.startswith("mismatch_kl")}
    assert set(kl) == {"fp32", "bf16 weights", "bf16 autocast (old mode)", "bf16 weights, trainer on bf16 copies",
                       "bf16 linears, fp32 embeddings and norms"}
    assert kl["fp32"] < 1e-8  # the same fp32 model, KV-cache decoding vs a full forward: rounding only
    assert all(v > 100 * kl["fp32"] for k, v in kl.items() if k != "fp32")  # bf16 computes differently
    assert rows["mean |trainer - sampler| log-prob: fp32"]["value"] < 1e-4


def test_memory_benchmark_quick(tmp_path):
    from tests.test_benchmarks import check_report, run_benchmark

    rows = check_report(run_benchmark("memory.py", tmp_path / "m.json", "--quick"), "memory")
    params = 139840  # the tiny Qwen2 shape (tests/test_gpu_check.py counts it)
    assert rows["server: computed params x 2 bytes"]["value"] == pytest.approx(params * 2 / 2**30)
    assert rows["trainer: computed params x 16 bytes"]["value"] == pytest.approx(params * 16 / 2**30)
    assert "torch.bfloat16" in rows["server: peak RSS"]["note"] and "torch.float32" in rows["trainer: peak RSS"]["note"]
    for name in ("server", "trainer", "trainer-gc"):
        assert rows[f"{name}: peak RSS"]["value"] > rows[f"{name}: peak RSS - RSS after imports"]["value"] > 0
