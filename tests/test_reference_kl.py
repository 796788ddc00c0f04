"""The KL to the reference policy through the trainer (issue 38): config, the reference itself, the update, the dump.

The loss formulas against verl's and TRL's are in tests/test_policy_loss_modes.py; here: that the trainer holds the
run's initial policy frozen (a copy, or LoRA's base), feeds its log-probs to the loss, reports the KL, and that a
dump replays the loss the trainer computed.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pydantic
import pytest
import torch
import yaml

from opsd.config import LoRASection, RunConfig, TrainerSection, config_hash, hashed_config, read_yaml
from opsd.credit.replay import check_file
from services.trainer.distributed import Message, decode_message, encode_message
from services.trainer.reference import ReferencePolicy
from services.trainer.step import learn
from services.trainer.update import sequence_logprobs
from tests.factories import VOCAB_SIZE, make_rollout_group, make_scored_group, ppo_sequences, tiny_llama


@pytest.mark.parametrize(("profile", "coef"), [("alfworld-7b", 0.01), ("webshop-3b", 0.01), ("search-3b", 0.001),
                                               ("search-7b", 0.001)])
def test_a_credit_profile_sets_the_recipes_kl_and_explicit_keys_win(profile, coef):
    cfg = RunConfig.model_validate({"credit": {"profile": profile}})
    assert (cfg.trainer.kl_coef, cfg.trainer.kl_estimator, cfg.trainer.entropy_coef) == (coef, "k3", 0.001)
    own = RunConfig.model_validate({"credit": {"profile": profile}, "trainer": {"kl_coef": 0.5, "kl_estimator": "k2"}})
    assert (own.trainer.kl_coef, own.trainer.kl_estimator) == (0.5, "k2")
    assert RunConfig.model_validate({"credit": {"profile": profile}, "trainer": {"kl_coef": 0}}).trainer.kl_coef == 0
    # A TrainerSection, not a dict (Python callers): the profile still applies under its explicitly set fields.
    obj = RunConfig(credit={"profile": profile}, trainer=TrainerSection(lr=1e-5))
    assert (obj.trainer.kl_coef, obj.trainer.kl_estimator, obj.trainer.lr) == (coef, "k3", 1e-5)
    obj = RunConfig(credit={"profile": profile}, trainer=TrainerSection(kl_coef=0.2, kl_estimator="k2"))
    assert (obj.trainer.kl_coef, obj.trainer.kl_estimator) == (0.2, "k2")
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # a saved config reads back the same


def test_new_loss_settings_at_their_defaults_leave_the_config_hash_alone():
    cfg = RunConfig()
    data = hashed_config(cfg)
    for key in ("kl_coef", "kl_estimator", "loss_agg", "importance_level", "tis_level", "tis_mode", "tis_cap_low"):
        assert key not in data["trainer"]
    assert "grpo_singleton" not in data["credit"]
    on = RunConfig.model_validate({"trainer": {"kl_coef": 0.01}})
    assert config_hash(hashed_config(on)) != config_hash(data)


def test_loss_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="tis_cap_low"):
        RunConfig.model_validate({"trainer": {"tis_cap": 2.0, "tis_cap_low": 2.0}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"trainer": {"kl_estimator": "k4"}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"trainer": {"clip_ratio_c": 1.0}})
    assert RunConfig.model_validate({"trainer": {"clip_ratio_c": None, "ppo_epochs": 2}}).trainer.clip_ratio_c is None
    for idle in ({"tis_level": "sequence"}, {"tis_mode": "mask"}, {"tis_cap_low": 0.1}, {"kl_estimator": "k1"},
                 {"loss_agg_norm_tokens": 512}):
        with pytest.raises(ValueError, match=f"trainer.{next(iter(idle))} set without effect"):
            RunConfig.model_validate({"trainer": idle})
    on = {"truncated_is": True, "tis_level": "sequence", "tis_mode": "mask", "tis_cap_low": 0.1, "kl_coef": 0.1,
          "kl_estimator": "k1", "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm_tokens": 512}
    assert RunConfig.model_validate({"trainer": on}).trainer.loss_agg_norm_tokens == 512


def test_verl_and_trl_spellings_are_told_the_opsd_key_and_verls_estimator_names_read_as_opsds():
    with pytest.raises(ValueError, match=r"trainer.use_kl_loss is not opsd's: write trainer.kl_coef .*"
                                         r"trainer.kl_loss_type is not opsd's: write trainer.kl_estimator"):
        RunConfig.model_validate({"trainer": {"use_kl_loss": True, "kl_loss_type": "low_var_kl"}})
    with pytest.raises(ValueError, match="trainer.loss_type is not opsd's: write trainer.loss_agg .*dr_grpo = seq-mean-token-sum-norm"):
        RunConfig.model_validate({"trainer": {"loss_type": "dr_grpo"}})
    for name, ours in (("low_var_kl", "k3"), ("kl", "k1"), ("mse", "k2"), ("k2", "k2")):
        assert RunConfig.model_validate({"trainer": {"kl_coef": 0.1, "kl_estimator": name}}).trainer.kl_estimator == ours


def test_a_boolean_for_a_number_and_a_repeated_yaml_key_are_refused(tmp_path):
    """`kl_coef: true` read as 1.0 (100x the recipe) and a second `trainer:` block silently replacing the first."""
    for section, key in (("trainer", "kl_coef"), ("trainer", "entropy_coef"), ("run", "steps"), ("rollout", "temperature")):
        with pytest.raises(ValueError, match="expects a number, got true"):
            RunConfig.model_validate({section: {key: True}})
    assert RunConfig.model_validate({"trainer": {"truncated_is": True}}).trainer.truncated_is is True  # a bool stays one
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1.0e-6\n  keep_optimizer_state: false\ntrainer:\n  kl_coef: 0.01\n")
    with pytest.raises(Exception, match="the key 'trainer' appears twice in one mapping"):
        RunConfig.load(path)
    path.write_text("base: &b {lr: 1.0e-6}\ntrainer:\n  <<: *b\n  kl_coef: 0.01\n")  # a YAML merge is not a repeat
    assert read_yaml(path)["trainer"] == {"lr": 1e-6, "kl_coef": 0.01}


def test_a_boolean_inside_a_list_of_numbers_is_refused_too(tmp_path):
    """`stop_token_ids: [true, 2]` was read as [1, 2] (and webshop goals [yes, no] as [1, 0]): the rule covers items."""
    path = tmp_path / "c.yaml"
    for text, where in (("model:\n  stop_token_ids: [true, 2]\n", "model.stop_token_ids"),
                        ("env:\n  webshop:\n    goals: [yes, no]\n", "env.webshop.goals"),
                        ("credit:\n  diagnostic_prompt_buckets: [true, 2048]\n", "credit.diagnostic_prompt_buckets"),
                        ("teacher:\n  source: model\n  model: {name: tiny-random, stop_token_ids: [0, off]}\n",
                         "teacher.model.stop_token_ids")):
        path.write_text(text)
        with pytest.raises(pydantic.ValidationError, match=rf"{where}\n.*expects a number, got a boolean in \["):
            RunConfig.load(path)
    path.write_text("model:\n  stop_token_ids: [1, 2]\n  chat_template_kwargs: {enable_thinking: no, depth: 2}\n")
    model = RunConfig.load(path).model  # numbers stay numbers; a template variable may be a bool beside numbers
    assert model.stop_token_ids == [1, 2] and model.chat_template_kwargs == {"enable_thinking": False, "depth": 2}


def test_a_repeated_merge_key_or_a_repeat_in_a_merged_mapping_is_refused_and_an_override_is_not(tmp_path):
    """PyYAML merges two `<<` keys and an inline mapping merged in without a check; a merged anchor that is itself
    a merge, aliased again later, was refused as a repeat (its expanded keys hold the override)."""
    path = tmp_path / "c.yaml"
    for text, message in (("a: &a {lr: 1}\nb: &b {lr: 2}\ntrainer:\n  <<: *a\n  <<: *b\n", "merge key << appears twice"),
                          ("trainer:\n  <<: {lr: 1, lr: 2}\n", "the key 'lr' appears twice"),
                          ("trainer:\n  <<: [{lr: 1}, {kl_coef: 1, kl_coef: 2}]\n", "the key 'kl_coef' appears twice")):
        path.write_text(text)
        with pytest.raises(yaml.YAMLError, match=message):
            read_yaml(path)
    path.write_text("b: &b {x: 1}\na:\n  <<: &c\n    <<: *b\n    x: 2\n  y: 3\nd: *c\n")
    assert read_yaml(path) == {"b": {"x": 1}, "a": {"x": 2, "y": 3}, "d": {"x": 2}}


def test_the_ratio_settings_need_a_second_epoch_and_gc_opd_has_no_entropy_bonus():
    """One optimizer step per epoch over the whole step: the first epoch's ratio is exactly 1, so GSPO and the dual
    clip act only with ppo_epochs > 1 (refused otherwise). spec 5: entropy bonus 0 for GC-OPD, 0.001 elsewhere."""
    for idle in ({"importance_level": "sequence"}, {"clip_ratio_c": None}, {"tis_cap": 2.0}):
        with pytest.raises(ValueError, match=f"trainer.{next(iter(idle))} set without effect"):
            RunConfig.model_validate({"trainer": idle})
        if "tis_cap" not in idle:
            RunConfig.model_validate({"trainer": {**idle, "ppo_epochs": 2}})
    assert RunConfig.model_validate({"run": {"method": "gc_opd"}}).trainer.entropy_coef == 0.0
    assert RunConfig.model_validate({"run": {"method": "grpo"}}).trainer.entropy_coef == 0.001
    own = RunConfig.model_validate({"run": {"method": "gc_opd"}, "trainer": {"entropy_coef": 0.01}})
    assert own.trainer.entropy_coef == 0.01


def test_grpo_singleton_comes_from_the_run_config():
    """A task with one trajectory: "zero" gives it advantage 0, "reference" its raw reward / (1 + 1e-6)."""
    from opsd.credit import compute_advantages
    from services.trainer.batch import build_credit_batch

    groups = [make_rollout_group(G=1, turns=2, seed=3, rewards=[2.0])]
    batch, _ = build_credit_batch(groups, None)
    mask = batch.loss_mask_ML > 0
    got = {}
    for choice in (None, "zero", "reference"):
        cfg = RunConfig.model_validate({"credit": {"grpo_singleton": choice, "grpo_scope": "trajectory",
                                                   "use_invalid_action_penalty": False}})
        adv, _ = compute_advantages("grpo", batch, cfg.credit)
        got[choice] = np.unique(adv[mask])
    assert got[None].tolist() == got["zero"].tolist() == [0.0]
    assert got["reference"] == pytest.approx([2.0 / (1 + 1e-6)], rel=1e-6)


def _cfg(**trainer):
    return RunConfig.model_validate({"trainer": {"micro_batch_size": 2, "entropy_coef": 0.0, **trainer}})


def test_the_reference_is_the_initial_policy_frozen_while_the_policy_trains():
    model = tiny_llama()
    seqs = ppo_sequences(1.0, True)
    before = sequence_logprobs(model, seqs)
    ref = ReferencePolicy.build(model, _cfg(kl_coef=0.01))
    assert not ref.adapters_off and all(not p.requires_grad for p in ref.module.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):  # the policy moves away
        from services.trainer.update import ppo_update

        ppo_update(model, opt, seqs, _cfg().trainer)
    moved = sequence_logprobs(model, seqs)
    assert max(np.abs(a - b).max() for a, b in zip(moved, before)) > 1e-2
    for a, b in zip(ref.logprobs(seqs, "float32", 1.0, 2), before):
        np.testing.assert_array_equal(a, b)


def test_with_lora_the_reference_is_the_base_without_a_copy_and_the_adapters_still_train():
    from opsd.lora import apply_lora

    base = tiny_llama()
    seqs = ppo_sequences(1.0, True)
    want = sequence_logprobs(base, seqs)
    model = copy.deepcopy(base)
    apply_lora(model, LoRASection(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # adapters away from B = 0: the policy is no longer the base
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ref = ReferencePolicy.build(model, _cfg(kl_coef=0.01))
    assert ref.adapters_off and ref.module is model
    assert max(np.abs(a - b).max() for a, b in zip(sequence_logprobs(model, seqs), want)) > 1e-3
    for a, b in zip(ref.logprobs(seqs, "float32", 1.0, 2), want):
        np.testing.assert_allclose(a, b, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # switched back on, trainable again


def test_the_kl_term_is_zero_at_the_reference_and_pulls_the_policy_back_to_it():
    """Step 0: policy = reference, so k3 = 0 exactly. After the policy moved, the KL is positive, and with only the
    KL term in the loss (advantages 0) an update lowers it."""
    from services.trainer.update import ppo_update

    model = tiny_llama()
    ref = ReferencePolicy.build(model, _cfg(kl_coef=1.0))
    seqs = ppo_sequences(1.0, True)
    with_ref = [replace(s, ref_logprobs_S=lp) for s, lp in zip(seqs, ref.logprobs(seqs, "float32", 1.0, 2))]
    cfg = _cfg(kl_coef=1.0, grad_clip=1e9).trainer
    m0 = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), with_ref, cfg)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7)
    ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), seqs, _cfg().trainer)  # away from the reference
    still = [replace(s, advantages_S=np.zeros_like(s.advantages_S)) for s in with_ref]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kls = [ppo_update(model, opt, still, cfg)["kl"] for _ in range(5)]
    assert kls[0] > 1e-3 and all(b < a for a, b in zip(kls, kls[1:])), kls


def test_a_kl_coef_without_reference_log_probs_is_refused():
    from services.trainer.update import ppo_update

    model = tiny_llama()
    with pytest.raises(ValueError, match="reference policy's log-probs"):
        ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.1), ppo_sequences(1.0, True), _cfg(kl_coef=0.01).trainer)
    cfg = RunConfig.model_validate({"trainer": {"kl_coef": 0.01}})
    groups = [make_rollout_group(G=2, turns=2, seed=1)]
    with pytest.raises(ValueError, match="reference policy"):
        learn(cfg, tiny_llama(vocab_size=VOCAB_SIZE), torch.optim.SGD(model.parameters(), lr=0.1), groups, None)


def test_reference_log_probs_travel_to_the_other_ranks():
    seqs = [replace(s, ref_logprobs_S=np.linspace(-3, 0, len(s.token_ids_S)).astype(np.float32)) for s in ppo_sequences()]
    got = decode_message(encode_message(Message("update", seqs))).seqs
    for a, b in zip(got, seqs):
        np.testing.assert_array_equal(a.ref_logprobs_S, b.ref_logprobs_S)
    assert decode_message(encode_message(Message("update", ppo_sequences()))).seqs[0].ref_logprobs_S is None


@pytest.mark.parametrize("trainer", [
    {"kl_coef": 0.05, "kl_estimator": "k3"},
    {"kl_coef": 0.05, "kl_estimator": "k1", "loss_agg": "seq-mean-token-mean", "truncated_is": True,
     "tis_level": "sequence", "tis_mode": "mask", "tis_cap": 3.0},
    {"kl_coef": 0.05, "kl_estimator": "k2", "loss_agg": "seq-mean-token-sum-norm", "importance_level": "sequence",
     "clip_ratio_c": None, "truncated_is": True, "tis_cap_low": 0.5, "micro_batch_size": 1},
])
def test_a_dump_replays_the_loss_and_kl_the_trainer_computed(trainer, tmp_path):
    """grpo_opd with SDAR, entropy bonus and the KL term: `opsd credit check` recomputes the first epoch's loss and
    KL from the dump within 1e-5; a dump whose loss was changed by 1e-3 fails."""
    cfg = RunConfig.model_validate({"run": {"method": "grpo_opd"}, "credit": {"sdar": {"coef": 0.01}},
                                    "trainer": {"entropy_coef": 0.01, "ppo_epochs": 2, **trainer}})
    scored = [make_scored_group(G=3, turns=3, seed=s) for s in (0, 1)]
    model = tiny_llama(num_hidden_layers=1, vocab_size=VOCAB_SIZE)
    ref = ReferencePolicy.build(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    learn(cfg, model, opt, [s.rollout for s in scored], scored, ref)  # the policy moves: step 2's KL is not 0
    dump = tmp_path / "step.json"
    res = learn(cfg, model, opt, [s.rollout for s in scored], scored, ref, dump)
    assert res.update["kl"] != 0  # k1 may be negative on a sample
    case = json.loads(dump.read_text())
    assert case["expected"]["kl"] != 0 and case["config"]["opsd_trainer"]["kl_coef"] == 0.05
    seqs = case["inputs"]["loss"]["sequences"]
    assert len(seqs) == 6 and all(len(s["ref_log_probs"]) == len(s["advantages"]) > 0 for s in seqs)
    r = check_file(dump)
    assert r.ok, (r.error, [(f.name, f.detail) for f in r.fields if not f.ok])
    assert {"loss", "kl", "advantages"} <= {f.name for f in r.fields}
    case["expected"]["loss"] += 1e-3
    dump.write_text(json.dumps(case))
    bad = check_file(dump)
    assert not bad.ok and [f.name for f in bad.fields if not f.ok] == ["loss"]


def test_a_bf16_reference_casts_its_weights_and_keeps_its_buffers():
    """model.dtype bfloat16: the copy holds 2 bytes a parameter (half the fp32 trainer's), ties kept, while buffers
    such as the rotary frequencies stay fp32 (casting them would move every position's angle)."""
    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    cfg = RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "trainer": {"kl_coef": 0.01}})
    ref = ReferencePolicy.build(model, cfg).module
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the policy is untouched
    assert ref.get_input_embeddings().weight is ref.get_output_embeddings().weight
    assert {b.dtype for b in ref.buffers() if b.is_floating_point()} == {torch.float32}
    lp = ReferencePolicy(ref, False).logprobs(ppo_sequences(), "bfloat16", 1.0, 2)
    want = sequence_logprobs(model, ppo_sequences(), "bfloat16")
    for a, b in zip(lp, want):  # bf16 weights vs bf16 autocast of fp32 weights: the same matmuls, up to bf16 rounding
        np.testing.assert_allclose(a, b, atol=0.05)


def test_the_loss_replay_pads_micro_batches_of_similar_lengths_not_the_whole_step(tmp_path, monkeypatch):
    """`opsd credit check` replays a dump's loss in micro-batches of at most MAX_REPLAY_PADDED padded values (or one
    sequence), as the trainer does: a file of a few MB with thousands of one-token sequences and one long one once
    became one [sequences, longest] batch per array (a 1 MB file: 2 GB). Split or not, the loss and KL are the same."""
    import opsd.credit.policy_loss as policy_loss
    from opsd.credit import replay

    cfg = RunConfig.model_validate({"run": {"method": "grpo_opd"}, "credit": {"sdar": {"coef": 0.01}}, "trainer": {
        "entropy_coef": 0.01, "kl_coef": 0.05, "kl_estimator": "k2", "loss_agg": "seq-mean-token-sum-norm",
        "importance_level": "sequence", "truncated_is": True, "tis_level": "sequence", "tis_cap": 3.0, "tis_cap_low": 0.5,
        "ppo_epochs": 2}})
    scored = [make_scored_group(G=3, turns=3, seed=s) for s in (0, 1)]
    model = tiny_llama(num_hidden_layers=1, vocab_size=VOCAB_SIZE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref = ReferencePolicy.build(model, cfg)
    learn(cfg, model, opt, [s.rollout for s in scored], scored, ref)
    dump = tmp_path / "step.json"
    learn(cfg, model, opt, [s.rollout for s in scored], scored, ref, dump)
    shapes = []
    real = policy_loss.ppo_loss
    monkeypatch.setattr(policy_loss, "ppo_loss", lambda lp, *a, **k: (shapes.append(tuple(lp.shape)), real(lp, *a, **k))[1])
    monkeypatch.setattr(replay, "MAX_REPLAY_PADDED", 40)
    r = check_file(dump)
    assert r.ok, (r.error, [(f.name, f.detail) for f in r.fields if not f.ok])
    assert len(shapes) > 1 and all(b * t <= 40 or b == 1 for b, t in shapes), shapes

    case = json.loads(dump.read_text())
    one = case["inputs"]["loss"]["sequences"][0]
    short = {k: v[:1] for k, v in one.items()}
    long = {k: (v * 100)[:1000] for k, v in one.items()}
    hostile = {"sequences": [short] * 300 + [long]}
    shapes.clear()
    split = replay.replay_loss(hostile, case["config"], cfg.credit)
    assert max(b * t for b, t in shapes) == 1000 and sum(b for b, _ in shapes) == 301, shapes
    monkeypatch.setattr(replay, "MAX_REPLAY_PADDED", 10**9)
    whole = replay.replay_loss(hostile, case["config"], cfg.credit)
    assert shapes[-1] == (301, 1000)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5) and split["kl"] == pytest.approx(whole["kl"], rel=1e-5)
    assert split["kl"] > 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_non_finite_reference_log_prob_skips_the_step(estimator, bad):
    """A reference that gives a loss token NaN or -inf (probability 0): the epoch is skipped and counted, the weights
    and the metrics stay finite. k3's clamp gave a NaN loss with a finite gradient (and k1's gradient never depends
    on the reference), so the step trained on with the token's KL term gone and `loss`/`kl` NaN or inf. k3 of -inf
    is verl's clamp at 10 (finite, no gradient): that step trains."""
    from services.trainer.update import ppo_update

    model = tiny_llama()
    ref = ReferencePolicy.build(model, _cfg(kl_coef=0.1))
    seqs = ppo_sequences(1.0, True)
    lps = ref.logprobs(seqs, "float32", 1.0, 2)
    lps[1][-1] = bad  # a loss token
    seqs = [replace(s, ref_logprobs_S=lp) for s, lp in zip(seqs, lps)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), seqs, _cfg(kl_coef=0.1, kl_estimator=estimator).trainer)
    trains = estimator == "k3" and bad == float("-inf")
    assert m["skipped_steps"] == (0.0 if trains else 1.0) and all(np.isfinite(v) for v in m.values()), m
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) != trains
    if trains:  # the token's k3 is 10, the others' 0 (policy = reference): the token-mean over 16 loss tokens
        assert m["kl"] == pytest.approx(10 / 16)


def test_the_reference_copy_owns_its_storage_in_model_dtype():
    """A bf16 reference holds 2 bytes a parameter; an fp32 one shares no storage with the policy (a `.to(float32)`
    of an fp32 tensor returns the tensor itself): training the policy in place leaves the reference unchanged."""
    model = tiny_llama()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    ref = ReferencePolicy.build(model, RunConfig.model_validate({"model": {"dtype": "bfloat16"}})).module
    assert sum(p.numel() * p.element_size() for p in ref.parameters()) == fp32_bytes // 2
    same = ReferencePolicy.build(model, RunConfig()).module
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in same.parameters()}
    assert all(not p.requires_grad for p in same.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))


def test_kl_is_reported_only_with_the_kl_term_and_shows_on_the_step_line():
    from opsd.progress import format_step
    from services.trainer.update import ppo_update

    model = tiny_llama()
    off = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), ppo_sequences(), _cfg().trainer)
    assert "kl" not in off
    seqs = [replace(s, ref_logprobs_S=np.full(len(s.token_ids_S), -4.0, np.float32)) for s in ppo_sequences()]
    on = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), seqs, _cfg(kl_coef=0.01).trainer)
    assert on["kl"] > 0
    assert "  kl 1.20e-04" in format_step({"step": 3, "loss": 0.5, "kl": 1.2e-4}) and " kl " not in format_step({"step": 3})
