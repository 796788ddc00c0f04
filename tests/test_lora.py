"""LoRA (opsd/lora.py): adapter files, merging on workers, validation, training and checkpoints with adapters."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

from opsd.config import LoRASection, ModelSection, RunConfig, TrainerSection, config_hash, hashed_config
from opsd.lora import AdapterError, adapter_state_dict, apply_lora, merged_weights, targeted_weights
from opsd.models.hf import HFBackend
from opsd.weights import DIGEST_KEY, ensure_version, weights_path
from tests.tiny_model import make_tiny_model_dir

LORA = LoRASection(r=4, alpha=12.0)  # scale 3: a wrong scale shows
TARGETS = LORA.target_modules  # q, k, v, o, gate, up, down
N_WEIGHTS = 2 * len(TARGETS)  # two layers


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-lora"))


def _backend(tiny_dir) -> HFBackend:
    return HFBackend(ModelSection(name=str(tiny_dir)))


def _randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give every lora_A / lora_B random values (B starts at 0, which would make every merge trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture
def trainer(tiny_dir):
    """The trainer's side: an HFBackend whose model carries adapters (random values, seed 1)."""
    backend = _backend(tiny_dir)
    torch.manual_seed(0)
    peft_model = apply_lora(backend.model, LORA)
    _randomize_adapters(backend.model, 1)
    backend.peft_model = peft_model  # for peft's own merge in the tests
    return backend


@pytest.fixture
def worker(tiny_dir):
    return _backend(tiny_dir)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _logits(model, ids_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_BT, attention_mask=torch.ones_like(ids_BT)).logits


IDS = torch.tensor([[1, 200, 3000, 45, 9, 17000, 5, 77], [2, 400, 12, 13, 14, 15, 16, 48000]])


def test_adapter_file_holds_only_adapter_tensors(trainer, tmp_path):
    path = weights_path(tmp_path, 3)
    trainer.policy_version = 3
    trainer.save_weights(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "opsd-lora" and meta["rank"] == "4" and float(meta["alpha"]) == 12.0
    assert json.loads(meta["target_modules"]) == sorted(TARGETS) and meta["policy_version"] == "3"
    tensors = load_file(str(path))
    base_names = [n for n in trainer.model.state_dict() if ".base_layer.weight" in n]
    assert len(base_names) == N_WEIGHTS
    expected = {n.replace(".base_layer.weight", s) for n in base_names for s in (".lora_A.weight", ".lora_B.weight")}
    assert set(tensors) == expected  # adapter tensors only: no base weight, no embedding, no norm
    live = trainer.model.state_dict()
    for name, t in tensors.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, live[name.replace(".weight", ".default.weight")])
    a = tensors["model.layers.1.mlp.down_proj.lora_A.weight"]
    b = tensors["model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 128) and b.shape == (64, 4)  # [r, in], [out, r]
    full = tmp_path / "full.safetensors"
    save_model(copy.deepcopy(trainer.peft_model).merge_and_unload(), str(full))
    assert path.stat().st_size * 50 < full.stat().st_size


def test_merged_weights_equal_peft_merge(trainer, worker, tmp_path):
    path = tmp_path / "a.safetensors"
    trainer.save_weights(path)
    base = worker.model.state_dict()
    merged = merged_weights(base, path)
    assert sorted(merged) == targeted_weights(base, TARGETS) and len(merged) == N_WEIGHTS
    peft_merged = copy.deepcopy(trainer.peft_model).merge_and_unload().state_dict()
    assert set(peft_merged) == set(base)
    for name, w in merged.items():
        assert w.dtype == base[name].dtype and w.shape == base[name].shape
        assert (w - peft_merged[name]).abs().max() <= 1e-6, name
        assert (w - base[name]).abs().max() > 1e-3, name  # the adapter really moved it
    for name in set(base) - set(merged):
        assert torch.equal(peft_merged[name], base[name])  # untargeted weights stay the base
    # merged_weights reads base_state only.
    assert all(torch.equal(base[n], t) for n, t in worker.model.state_dict().items())


def test_worker_logits_match_the_trainer_after_loading_an_adapter(trainer, worker, tmp_path):
    base_logits = _logits(worker.model, IDS)
    trainer.policy_version = 1
    trainer.save_weights(weights_path(tmp_path, 1))
    assert ensure_version(worker, tmp_path, 1) is True and worker.policy_version == 1
    want = _logits(trainer.model, IDS)  # peft's forward: x W0^T + scale * x A^T B^T
    got = _logits(worker.model, IDS)
    assert (got - want).abs().max() < 1e-4
    assert (got - base_logits).abs().max() > 1e-2
    # The worker's model is still a plain transformers model.
    assert not any(".lora_" in n for n in worker.model.state_dict())
    # And the sampler's log-probs agree with the trainer's scoring convention.
    seq = IDS[0].tolist()
    lp_worker = worker.score([seq], [3])[0]
    lp_trainer = trainer.score([seq], [3])[0]
    assert abs(lp_worker - lp_trainer).max() < 1e-4


def test_version_zero_adapter_is_the_base_model(tiny_dir, worker, tmp_path):
    trainer = _backend(tiny_dir)
    torch.manual_seed(0)
    apply_lora(trainer.model, LORA)  # B = 0: computes the base model exactly
    trainer.save_weights(weights_path(tmp_path, 0))
    before = _params(worker.model)
    worker.policy_version = -1  # force the load
    worker.load_weights(weights_path(tmp_path, 0), 0)
    assert all(torch.equal(before[n], p) for n, p in worker.model.named_parameters())


def test_loading_v2_after_v1_does_not_stack(trainer, worker, tiny_dir, tmp_path):
    base = worker.model.state_dict()
    base = {n: t.clone() for n, t in base.items()}
    trainer.save_weights(weights_path(tmp_path, 1))
    _randomize_adapters(trainer.model, 2)
    trainer.save_weights(weights_path(tmp_path, 2))
    v1, v2 = merged_weights(base, weights_path(tmp_path, 1)), merged_weights(base, weights_path(tmp_path, 2))
    ensure_version(worker, tmp_path, 1)
    ensure_version(worker, tmp_path, 2)
    live = worker.model.state_dict()
    for name, t in live.items():
        assert torch.equal(t, v2.get(name, base[name])), name
    fresh = _backend(tiny_dir)
    ensure_version(fresh, tmp_path, 2)
    assert torch.equal(_logits(fresh.model, IDS), _logits(worker.model, IDS))
    ensure_version(worker, tmp_path, 1)  # back to v1 (k-step-off may ask for an older version)
    live = worker.model.state_dict()
    assert all(torch.equal(t, v1.get(name, base[name])) for name, t in live.items())
    # The tie of embedding and LM head is untouched.
    assert worker.model.lm_head.weight.data_ptr() == worker.model.model.embed_tokens.weight.data_ptr()


def _rewrite(src, dst, edit_tensors=None, edit_meta=None):
    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    if edit_tensors:
        edit_tensors(tensors)
        meta.pop(DIGEST_KEY)  # other tensors: the recorded digest would refuse the file before any other check
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(dst), metadata=meta or None)
    return dst


Q = "model.layers.0.self_attn.q_proj"
BAD_ADAPTERS = {
    "wrong_shape": (lambda t: t.__setitem__(f"{Q}.lora_A.weight", torch.zeros(4, 63)), None, AdapterError, "q_proj"),
    "wrong_rank": (lambda t: t.__setitem__(f"{Q}.lora_B.weight", torch.zeros(64, 5)), None, AdapterError, r"\[out, 4\]"),
    "nan": (lambda t: t[f"{Q}.lora_B.weight"].__setitem__((3, 1), float("nan")), None, AdapterError, "NaN"),
    "inf": (lambda t: t[f"{Q}.lora_A.weight"].__setitem__((0, 0), float("inf")), None, AdapterError, "NaN or inf"),
    "missing_module": (lambda t: [t.pop(f"{Q}.lora_A.weight"), t.pop(f"{Q}.lora_B.weight")], None, AdapterError, "missing"),
    "missing_half": (lambda t: t.pop(f"{Q}.lora_B.weight"), None, AdapterError, "lacks lora_A or lora_B"),
    "foreign_tensor": (lambda t: t.__setitem__("model.norm.weight", torch.ones(64)), None, AdapterError, "model.norm.weight"),
    "unknown_module": (lambda t: [t.__setitem__(f"model.layers.7.self_attn.q_proj{s}", t[f"{Q}{s}"].clone())
                                  for s in (".lora_A.weight", ".lora_B.weight")], None, AdapterError, "unexpected"),
    "int_dtype": (lambda t: t.__setitem__(f"{Q}.lora_A.weight", torch.zeros(4, 64, dtype=torch.int32)), None,
                  AdapterError, "dtype"),
    "no_rank": (None, lambda m: m.pop("rank"), AdapterError, "lacks"),
    "bad_alpha": (None, lambda m: m.__setitem__("alpha", "nan"), AdapterError, "alpha"),
    "bad_targets": (None, lambda m: m.__setitem__("target_modules", '["q_proj"]'), AdapterError, "not among target_modules"),
    "fewer_targets": (lambda t: [t.pop(k) for k in list(t) if ".q_proj." not in k], lambda m: m.__setitem__(
        "target_modules", '["q_proj", "k_proj"]'), AdapterError, "missing"),
    # Without any metadata the file is no adapter: the full-file path refuses it by its keys.
    "no_metadata": (None, lambda m: m.clear(), KeyError, "missing"),
}


@pytest.fixture(scope="module")
def worker_at_v1(tiny_dir, tmp_path_factory):
    """A worker holding adapter version 1, and that file; shared by the bad-adapter cases (none may change it)."""
    trainer = _backend(tiny_dir)
    torch.manual_seed(0)
    apply_lora(trainer.model, LORA)
    _randomize_adapters(trainer.model, 1)
    run_dir = tmp_path_factory.mktemp("run")
    trainer.save_weights(weights_path(run_dir, 1))
    worker = _backend(tiny_dir)
    ensure_version(worker, run_dir, 1)
    return worker, weights_path(run_dir, 1)


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_leaves_the_backend_unchanged(case, worker_at_v1, tmp_path):
    worker, v1 = worker_at_v1
    before = _params(worker.model)
    edit_tensors, edit_meta, error, match = BAD_ADAPTERS[case]
    bad = _rewrite(v1, tmp_path / "bad.safetensors", edit_tensors, edit_meta)
    with pytest.raises(error, match=match):
        worker.load_weights(bad, 2)
    assert worker.policy_version == 1
    assert all(torch.equal(before[n], p) for n, p in worker.model.named_parameters())
    if error is AdapterError:  # the vLLM path refuses it the same way
        with pytest.raises(AdapterError):
            merged_weights(worker.model.state_dict(), bad)


def test_missing_file_is_file_not_found(worker, tmp_path):
    with pytest.raises(FileNotFoundError):
        worker.load_weights(weights_path(tmp_path, 4), 4)
    with pytest.raises(FileNotFoundError):
        merged_weights(worker.model.state_dict(), tmp_path / "nope.safetensors")
    assert worker.policy_version == 0


def test_adapter_after_a_full_file_is_refused(trainer, worker, tmp_path):
    full = tmp_path / "full.safetensors"
    worker.save_weights(full)
    worker.load_weights(full, 1)  # the weights now come from a file, not the initial model
    trainer.save_weights(weights_path(tmp_path, 2))
    before = _params(worker.model)
    with pytest.raises(AdapterError, match="full weights file"):
        worker.load_weights(weights_path(tmp_path, 2), 2)
    assert worker.policy_version == 1 and all(torch.equal(before[n], p) for n, p in worker.model.named_parameters())


def test_ppo_update_with_lora_changes_only_adapter_weights():
    from services.trainer.update import ppo_update
    from tests.factories import ppo_sequences, tiny_llama

    model = tiny_llama(num_hidden_layers=2, seed=0)
    torch.manual_seed(0)
    apply_lora(model, LoRASection(r=2, alpha=4.0))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = _params(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    out = ppo_update(model, opt, ppo_sequences(adv=1.0), TrainerSection(micro_batch_size=2))
    assert out["loss_tokens"] > 0 and out["skipped_steps"] == 0
    after = _params(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)
    assert all(n in changed for n in trainable if ".lora_B." in n)  # B got a gradient (A only decays while B = 0)
    tensors, rank, alpha, targets = adapter_state_dict(model)
    assert rank == 2 and alpha == 4.0 and len(tensors) == 2 * 2 * len(targets)


def test_checkpoint_round_trip_with_lora(tmp_path):
    """services/trainer/checkpoint.py works unchanged on the adapted model: base + adapters + adapter optimizer."""
    from services.trainer.checkpoint import TrainerState, find_checkpoint, load_checkpoint, save_checkpoint
    from services.trainer.update import ppo_update
    from tests.factories import ppo_sequences, tiny_llama

    cfg = RunConfig.model_validate({"trainer": {"lora": {"r": 2, "alpha": 4.0}}})
    hashed = hashed_config(cfg)
    assert config_hash(hashed) != config_hash(hashed_config(RunConfig()))  # LoRA on/off is no resumable change

    def make(seed):
        model = tiny_llama(num_hidden_layers=2, seed=seed)
        torch.manual_seed(seed)
        apply_lora(model, cfg.trainer.lora)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = make(0)
    ppo_update(model, opt, ppo_sequences(adv=1.0), cfg.trainer)
    state = TrainerState(step=1, policy_version=1, method=cfg.run.method, config_hash=config_hash(hashed),
                         applied=["g@v0"], counts={"trained": 1, "dropped_stale": 0, "dropped_duplicate": 0})
    save_checkpoint(tmp_path, model, opt, state, hashed, [{"step": 0}])
    other, other_opt = make(5)  # a restarted trainer: another seed's base and adapters
    assert load_checkpoint(find_checkpoint(tmp_path), other, other_opt, hashed) == state
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    # Both continue identically: the optimizer state came back too.
    ppo_update(model, opt, ppo_sequences(adv=-1.0), cfg.trainer)
    ppo_update(other, other_opt, ppo_sequences(adv=-1.0), cfg.trainer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_apply_lora_refuses_bad_targets(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="match no module"):
        apply_lora(model, LoRASection(target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError, match="Embedding"):
        apply_lora(model, LoRASection(target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match="tied"):
        apply_lora(model, LoRASection(target_modules=["lm_head"]))  # tied to the embedding
    assert not any(".lora_" in n for n in model.state_dict())
    with pytest.raises(ValueError, match="plain module names"):
        LoRASection(target_modules=["self_attn.q_proj"])
    assert TrainerSection().lora is None  # full fine-tuning by default


def test_full_files_still_load_and_adapters_after_them_use_the_kept_base(trainer, worker, tmp_path):
    base = {n: t.clone() for n, t in worker.model.state_dict().items()}
    full = tmp_path / "full.safetensors"
    worker.save_weights(full)  # a plain model still writes a full state dict
    with safe_open(str(full), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and len(f.keys()) == len(dict(worker.model.named_parameters()))
    trainer.save_weights(weights_path(tmp_path, 1))
    ensure_version(worker, tmp_path, 1)
    worker.load_weights(full, 2)  # full file over a merged adapter: the base is back
    assert worker.policy_version == 2
    assert all(torch.equal(t, base[n]) for n, t in worker.model.state_dict().items())
    _randomize_adapters(trainer.model, 3)
    trainer.save_weights(weights_path(tmp_path, 3))
    ensure_version(worker, tmp_path, 3)
    v3 = merged_weights(base, weights_path(tmp_path, 3))
    assert all(torch.equal(t, v3.get(n, base[n])) for n, t in worker.model.state_dict().items())


def test_save_merged_leaves_a_plain_model_of_the_adapted_policy(trainer, tmp_path):
    """A LoRA run's checkpoint keeps peft's names; `final_model/` loads with from_pretrained as the trained policy."""
    from transformers import AutoModelForCausalLM

    from opsd.lora import save_merged

    _randomize_adapters(trainer.model, 3)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    save_merged(trainer.model, trainer.tokenizer, tmp_path / "final_model")
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # not modified
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model", local_files_only=True)
    assert not any(".lora_" in k or ".base_layer." in k for k in plain.state_dict())
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert float((want - got).abs().max()) < 1e-5
    assert float((want - torch.zeros_like(want)).abs().max()) > 0  # a real forward
