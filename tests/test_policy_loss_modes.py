"""The loss options verl and TRL users switch between (issue 38): loss_agg, GSPO, clip_c=None, KL estimators,
importance_weight. Each mode is checked against an independent float64 numpy reference written from the
published formula of:
  verl b178a3cd56f58b2d502255daba591e92833930a7: verl/trainer/ppo/core_algos.py (agg_loss,
    compute_policy_loss_vanilla, compute_policy_loss_gspo, kl_penalty_forward) and
    verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, SAFETY_BOUND = 20);
  TRL f2cd57710ae345ea6428ae95363267fcf38a3dc8: trl/trainer/grpo_trainer.py (_compute_loss: loss_type
    grpo / dr_grpo, importance_sampling_level; the vllm_importance_sampling_mode block near line 2579).
verl's tests/trainer/ppo/test_core_algos_on_cpu.py has no policy-loss numbers and TRL's tests/test_grpo_trainer.py
only trains end to end; the one concrete case is verl's tests/trainer/ppo/test_rollout_corr.py::test_mask_mode.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opsd.credit.policy_loss import LOSS_AGG_MODES, importance_weight, kl_penalty, ppo_loss

CLIP_LOW, CLIP_HIGH, ENT_COEF, KL_COEF, NORM_TOKENS = 0.2, 0.28, 0.01, 0.05, 16


# ---- the published formulas, float64 numpy (inputs are the float32 values opsd sees, padding zeroed) ----

def _np_ratio(logp, old, mask, level):
    if level == "token":  # compute_policy_loss_vanilla: exp(clamp(log_prob - old_log_prob, -20, 20))
        return np.exp(np.clip(logp - old, -20.0, 20.0))
    # compute_policy_loss_gspo: sum((log_prob - old) * mask) / clamp(len, 1), then clamp(max=10), on every token
    seq = ((logp - old) * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
    return np.broadcast_to(np.exp(np.minimum(seq, 10.0))[:, None], logp.shape)


def _np_pg(ratio, adv, clip_c):
    clipped = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    if clip_c is None:
        return clipped
    return np.where(adv < 0, np.minimum(clipped, -adv * clip_c), clipped)


def _np_kl(logp, ref, estimator):  # kl_penalty_forward
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = np.clip(ref - logp, -20, 20)
    return np.clip(np.exp(d) - d - 1, -10, 10)


def _np_agg(x, mask, mode, n_tokens, n_seqs):
    """verl agg_loss with the global denominators (batch_num_tokens, global_batch_size); sum-norm as TRL dr_grpo."""
    if mode == "token-mean":
        return (x * mask).sum() / n_tokens
    lens = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        return ((x * mask).sum(-1) / (lens + 1e-8) * (lens > 0)).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return ((x * mask).sum(-1) * (lens > 0)).sum() / n_seqs
    return (x * mask).sum() / (n_seqs * NORM_TOKENS)  # TRL: sum / (B * max_completion_length)


def _np_importance_weight(old, sampler, mask, level, mode, cap, cap_low):
    diff = (old - sampler) * mask
    if level == "sequence":  # verl rollout_is="sequence": masked_sum over the row, then the +-20 bound
        diff = np.broadcast_to(diff.sum(-1, keepdims=True), diff.shape)
    w = np.exp(np.clip(diff, -20, 20))
    if mode == "truncate":  # TRL *_truncate: clamp(ratio, clip_min, clip_max)
        w = np.clip(w, cap_low, cap)
    else:  # TRL *_mask: ratio < clip_min or > clip_max -> 0
        w = np.where((w > cap) | (w < (cap_low if cap_low is not None else -np.inf)), 0.0, w)
    return w * mask


# ---- inputs ----

def _case(seed: int, extreme: bool) -> dict[str, np.ndarray]:
    """6 x 7 float32 arrays: row 0 fully masked, row 1 one token, row 2 all-zero advantages (equal rewards);
    `extreme` puts log-ratios of +-1e4 on rows 3-4 and a ref gap of 1e4 on row 5 (every clamp is hit)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((6, 7)) < 0.7
    mask[0] = False
    mask[1] = False
    mask[1, 3] = True
    mask[2:, 0] = True
    logp = -rng.exponential(1.0, (6, 7))
    old = logp + rng.normal(0, 0.3, (6, 7))
    ref = logp + rng.normal(0, 0.5, (6, 7))
    adv = rng.normal(0, 1, (6, 7))
    adv[2] = 0.0
    if extreme:
        old[3] = logp[3] - 1e4
        old[4, 0] = logp[4, 0] + 1e4
        ref[5] = logp[5] + 1e4 * np.sign(rng.normal(size=7))
    weight = rng.uniform(0, 3, (6, 7)) * (rng.random((6, 7)) > 0.2)
    arrays = dict(logp=logp, old=old, ref=ref, adv=adv, ent=rng.uniform(0, 2, (6, 7)), weight=weight)
    clean = {k: np.where(mask, v, 0.0).astype(np.float32).astype(np.float64) for k, v in arrays.items()}
    return clean | {"mask": mask.astype(np.float64)}


def _padded(case: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """float32 tensors with inf/NaN padding off the mask, which must never reach the loss."""
    off = case["mask"] == 0
    junk = {"logp": -np.inf, "old": np.nan, "ref": -np.inf, "adv": np.nan, "ent": np.inf, "weight": np.nan}
    out = {k: torch.tensor(np.where(off, junk[k], v), dtype=torch.float32) for k, v in case.items() if k in junk}
    return out | {"mask": torch.tensor(case["mask"], dtype=torch.float32)}


def _opsd(t, mode, level, estimator, clip_c, rows=slice(None), n_seqs=None):
    mask = t["mask"]
    lp = t["logp"][rows].clone().requires_grad_(True)
    loss, metrics = ppo_loss(
        lp, t["old"][rows], t["adv"][rows], mask[rows], float(mask.sum()), CLIP_LOW, CLIP_HIGH, clip_c,
        entropy_BT=t["ent"][rows], entropy_coef=ENT_COEF, ref_logprobs_BT=t["ref"][rows], kl_coef=KL_COEF,
        is_weight_BT=t["weight"][rows], loss_agg=mode, total_sequences=n_seqs or int(mask.any(-1).sum()),
        norm_tokens=NORM_TOKENS, importance_level=level, kl_estimator=estimator,
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_matches_the_published_formulas(mode, level, estimator, seed):
    case = _case(seed, extreme=seed % 2 == 1)
    clip_c = 3.0 if seed < 2 else None
    m, n_tokens, n_seqs = case["mask"], case["mask"].sum(), (case["mask"].sum(-1) > 0).sum()
    pg = _np_pg(_np_ratio(case["logp"], case["old"], m, level), case["adv"], clip_c) * case["weight"]
    kl = _np_kl(case["logp"], case["ref"], estimator)
    # verl dp_actor: pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl), each with loss_agg_mode.
    terms = [_np_agg(x, m, mode, n_tokens, n_seqs) for x in (pg, case["ent"], kl)]
    abs_terms = [_np_agg(np.abs(x), m, mode, n_tokens, n_seqs) for x in (pg, case["ent"], kl)]
    expected = terms[0] - ENT_COEF * terms[1] + KL_COEF * terms[2]
    float32_slack = 1e-6 * (abs_terms[0] + ENT_COEF * abs_terms[1] + KL_COEF * abs_terms[2])

    loss, grad, metrics = _opsd(_padded(case), mode, level, estimator, clip_c)
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=float32_slack)
    assert torch.isfinite(grad).all() and not grad[case["mask"] == 0].any()
    kl_slack = 1e-6 * (np.abs(kl) * m).sum() / n_tokens  # +-1e4 gaps cancel: float32 error scales with sum |kl|
    assert metrics["ppo/kl_mean"] == pytest.approx((kl * m).sum() / n_tokens, rel=1e-6, abs=kl_slack)
    assert metrics["ppo/loss_sequences"] == n_seqs == 5
    assert metrics["ppo/is_masked_frac"] == pytest.approx(((case["weight"] == 0) & (m > 0)).sum() / n_tokens)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient(mode, level):
    """Rows [0] (fully masked), [1, 2], [3, 4, 5] as micro-batches, each given the whole mini-batch's N and S."""
    t = _padded(_case(7, extreme=False))
    whole_loss, whole_grad, _ = _opsd(t, mode, level, "k3", 3.0)
    parts = [_opsd(t, mode, level, "k3", 3.0, rows=slice(a, b), n_seqs=5) for a, b in ((0, 1), (1, 3), (3, 6))]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole_loss), rel=1e-6)
    assert torch.allclose(torch.cat([p[1] for p in parts]), whole_grad, rtol=1e-6, atol=1e-9)
    assert float(parts[0][0]) == 0.0 and not parts[0][1].any()
    assert all(p[1].abs().sum() > 1e-4 for p in parts[1:])  # both non-empty parts carry a gradient


def test_worked_example_two_sequences_of_one_and_three_tokens():
    # ratio 1 (logp = old). Row 0: one token, A = -2 -> token loss 2. Row 1: three tokens, A = (-1, 0, 0) -> 1, 0, 0.
    #   token-mean              (2 + 1) / 4 tokens       = 0.75;   d/dlogp = -A / 4:             0.5 | 0.25, 0, 0
    #   seq-mean-token-mean     (2/1 + 1/3) / 2 seqs     = 7/6;    d/dlogp = -A / (n_b * 2):     1.0 | 1/6, 0, 0
    #   seq-mean-token-sum      (2 + 1) / 2 seqs         = 1.5;    d/dlogp = -A / 2:             1.0 | 0.5, 0, 0
    #   seq-mean-token-sum-norm (2 + 1) / (2 seqs * 3)   = 0.5;    d/dlogp = -A / 6:             1/3 | 1/6, 0, 0
    expected = {"token-mean": (0.75, [0.5, 0.25]), "seq-mean-token-mean": (7 / 6, [1.0, 1 / 6]),
                "seq-mean-token-sum": (1.5, [1.0, 0.5]), "seq-mean-token-sum-norm": (0.5, [1 / 3, 1 / 6])}
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[-2.0, 0, 0], [-1, 0, 0]])
    for mode, (value, (g0, g1)) in expected.items():
        lp = torch.full((2, 3), -0.5, requires_grad=True)
        loss, _ = ppo_loss(lp, lp.detach().clone(), adv, mask, 4, loss_agg=mode, total_sequences=2, norm_tokens=3)
        loss.backward()
        assert loss.item() == pytest.approx(value, rel=1e-6), mode
        assert lp.grad[0].tolist() == pytest.approx([g0, 0, 0], rel=1e-6), mode
        assert lp.grad[1].tolist() == pytest.approx([g1, 0, 0], rel=1e-6), mode


def test_gspo_worked_example():
    # One row of 2 tokens, logp - old = (ln 2, 0): the sequence ratio is exp(ln 2 / 2) = sqrt 2 on both tokens.
    # A = 1, clip_high 0.5: sqrt 2 < 1.5 is unclipped, loss = -sqrt 2 (seq-mean-token-mean, S = 1) and each token's
    # gradient is -A sqrt 2 / (2 tokens * 1 seq) = -0.7071. With clip_high 0.2 it is clipped: loss -1.2, gradient 0.
    # Token level instead: ratios 2 and 1, loss (-1.5 - 1) / 2 = -1.25 with gradient (0, -0.5).
    old = torch.tensor([[-1.0 - math.log(2.0), -1.0]])
    for level, clip_high, value, grad in (("sequence", 0.5, -math.sqrt(2), [-math.sqrt(2) / 2] * 2),
                                          ("sequence", 0.2, -1.2, [0.0, 0.0]), ("token", 0.5, -1.25, [0.0, -0.5])):
        lp = torch.full((1, 2), -1.0, requires_grad=True)
        loss, m = ppo_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), 2, 0.2, clip_high, None,
                           loss_agg="seq-mean-token-mean", total_sequences=1, importance_level=level)
        loss.backward()
        assert loss.item() == pytest.approx(value, rel=1e-6)
        assert lp.grad.tolist()[0] == pytest.approx(grad, abs=1e-7)
    assert m["ppo/ratio_mean"] == pytest.approx(1.5, rel=1e-6)  # token level: (2 + 1) / 2


def _gspo_grad(case, n_seqs):
    """The analytic gradient of GSPO-token (verl) = TRL's sequence-level loss with one advantage per row:
    d/dlogp_bt = -w_b A s_b / (n_b S) where the unclipped term is the max (and the sequence log-ratio < 10), else 0."""
    m, adv, w = case["mask"], case["adv"], case["weight"]
    n = m.sum(-1, keepdims=True)
    seq = ((case["logp"] - case["old"]) * m).sum(-1, keepdims=True) / np.maximum(n, 1)
    s = np.exp(np.minimum(seq, 10.0))
    unclipped = (-adv * s >= -adv * np.clip(s, 1 - CLIP_LOW, 1 + CLIP_HIGH)) & (seq < 10.0)
    return np.where(unclipped & (m > 0), -w * adv * s / (np.maximum(n, 1) * n_seqs), 0.0)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_gspo_equals_verl_compute_policy_loss_gspo(seed):
    """verl's GSPO: per-token advantages, no dual clip, seq-mean-token-mean, rollout IS weight times pg; here
    with log-ratios of +-1e4 on some rows, so the clamp at 10 and the empty row are covered."""
    case = _case(seed, extreme=seed == 12)
    m = case["mask"]
    n_seqs = int((m.sum(-1) > 0).sum())
    pg = _np_pg(_np_ratio(case["logp"], case["old"], m, "sequence"), case["adv"], None) * case["weight"]
    t = _padded(case)
    lp = t["logp"].clone().requires_grad_(True)
    loss, _ = ppo_loss(lp, t["old"], t["adv"], t["mask"], float(m.sum()), CLIP_LOW, CLIP_HIGH, None,
                       is_weight_BT=t["weight"], loss_agg="seq-mean-token-mean", total_sequences=n_seqs,
                       importance_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(_np_agg(pg, m, "seq-mean-token-mean", m.sum(), n_seqs), rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(lp.grad.numpy(), _gspo_grad(case, n_seqs), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("seed", [20, 21, 22])
def test_gspo_with_one_advantage_per_sequence_equals_trl_sequence_level(seed):
    """TRL importance_sampling_level="sequence", loss_type="grpo": coef_1 = exp(mean log-ratio) [B, 1];
    per-sequence loss -min(coef_1 A, clamp(coef_1, 1 - eps_low, 1 + eps_high) A) times the sequence IS ratio;
    loss = its mean over the B rows (all non-empty here: TRL would count an empty row). Value and gradient."""
    rng = np.random.default_rng(seed)
    case = _case(seed, extreme=False)
    m = case["mask"]
    m[0, :2] = 1.0  # every row non-empty, so TRL's B = S
    case["logp"], case["old"] = case["logp"] * m, (case["logp"] + rng.normal(0, 0.4, m.shape).astype(np.float32)) * m
    a = rng.normal(0, 1, 6).astype(np.float32).astype(np.float64)  # one advantage and one IS weight per row
    w = rng.uniform(0.5, 2, 6).astype(np.float32).astype(np.float64)
    case["adv"], case["weight"] = a[:, None] * m, w[:, None] * m
    n = m.sum(-1)
    coef_1 = np.exp(((case["logp"] - case["old"]) * m).sum(-1) / np.maximum(n, 1))
    per_seq = -np.minimum(coef_1 * a, np.clip(coef_1, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a) * w
    trl_loss = per_seq.mean()
    trl_grad = np.where((coef_1 * a <= np.clip(coef_1, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)[:, None] & (m > 0),
                        -(w * a * coef_1 / n)[:, None] / 6, 0.0)  # d coef_1 / d logp_bt = coef_1 / n_b
    assert np.allclose(trl_grad, _gspo_grad(case, 6))

    t = _padded(case)
    lp = t["logp"].clone().requires_grad_(True)
    loss, _ = ppo_loss(lp, t["old"], t["adv"], t["mask"], float(m.sum()), CLIP_LOW, CLIP_HIGH, None,
                       is_weight_BT=t["weight"], loss_agg="seq-mean-token-mean", total_sequences=6,
                       importance_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss, rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(lp.grad.numpy(), trl_grad, rtol=1e-5, atol=1e-9)
    assert (np.abs(trl_grad) > 0).sum() >= 10  # the gradient claim is not vacuous


def test_clip_c_none_turns_the_dual_clip_off():
    # A = -1, ratio 5: dual clip min(max(5, 1.2), 3) = 3 (no gradient); without it 5, gradient ratio = 5.
    old = torch.zeros(1, 1)
    for clip_c, value, grad, frac in ((3.0, 3.0, 0.0, 1.0), (None, 5.0, 5.0, 0.0)):
        lp = torch.log(torch.tensor([[5.0]])).requires_grad_(True)
        loss, m = ppo_loss(lp, old, -torch.ones(1, 1), torch.ones(1, 1), 1, clip_c=clip_c)
        loss.backward()
        assert loss.item() == pytest.approx(value, rel=1e-6) and float(lp.grad) == pytest.approx(grad, rel=1e-6)
        assert m["ppo/dual_clip_frac"] == frac


def test_kl_estimators_by_hand_values_gradients_and_clamps():
    # logp = 0, ref = ln 2: k1 = -ln 2, k2 = (ln 2)^2 / 2, k3 = 2 - ln 2 - 1; d/dlogp: 1, logp - ref, 1 - exp(ref - logp).
    ln2 = math.log(2.0)
    for est, value, grad in (("k1", -ln2, 1.0), ("k2", ln2**2 / 2, -ln2), ("k3", 1 - ln2, -1.0)):
        lp = torch.zeros(1, 1, requires_grad=True)
        kl = kl_penalty(lp, torch.full((1, 1), ln2), est)
        kl.sum().backward()
        assert kl.dtype == torch.float32 and kl.item() == pytest.approx(value, rel=1e-6)
        assert float(lp.grad) == pytest.approx(grad, rel=1e-6)
    gap = torch.tensor([[1e4, -1e4, 50.0]])  # ref - logp
    assert kl_penalty(torch.zeros(1, 3), gap, "k1").tolist()[0] == [-1e4, 1e4, -50.0]  # unclamped, like verl
    assert kl_penalty(torch.zeros(1, 3), gap, "k2").tolist()[0] == [5e7, 5e7, 1250.0]
    assert kl_penalty(torch.zeros(1, 3), gap, "k3").tolist()[0] == [10.0, 10.0, 10.0]  # exp(20) - 21 -> 10; e^-20 + 19 -> 10
    lp = torch.zeros(1, 2, requires_grad=True)
    _, m = ppo_loss(lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 2, ref_logprobs_BT=torch.tensor([[ln2, 0.0]]),
                    kl_coef=1.0, kl_estimator="k2")
    assert m["ppo/kl_mean"] == pytest.approx(ln2**2 / 4, rel=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, lp.detach(), "low_var_kl")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap_low", [None, 0.5])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weight_matches_verl_and_trl(level, mode, cap_low, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((5, 6)) < 0.7
    mask[0] = False
    old = rng.normal(-1, 1, (5, 6)).astype(np.float32)
    sampler = (old + rng.normal(0, 0.4 if seed < 2 else 30, (5, 6))).astype(np.float32)  # seed 2: beyond +-20
    expected = _np_importance_weight(np.where(mask, old, 0.0).astype(np.float64), np.where(mask, sampler, 0.0),
                                     mask.astype(np.float64), level, mode, 2.0, cap_low)
    w = importance_weight(torch.tensor(np.where(mask, old, np.nan)), torch.tensor(np.where(mask, sampler, np.inf)),
                          torch.tensor(mask), level, mode, cap=2.0, cap_low=cap_low)
    assert w.dtype == torch.float32 and not w.requires_grad
    # A float32 sum of six log-ratios of size 30 is off by ~1e-5 nats, which exp turns into a relative error.
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6 if level == "token" or seed < 2 else 2e-5, atol=1e-12)
    if level == "sequence":  # one weight per row
        assert all(len(set(w[b][torch.tensor(mask[b])].tolist())) <= 1 for b in range(5))


def test_importance_weight_verl_test_mask_mode_numbers():
    """verl tests/trainer/ppo/test_rollout_corr.py::test_mask_mode (lines 311-358): old -2, rollout -1 / -2.5 on
    two 5-token rows; token weights 0.368 and 1.649 (cap 2), and bounds [0.5, 2] reject the first row (50%)."""
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    w = importance_weight(old, rollout, mask, "token", "truncate", cap=2.0)
    assert float(w[0, 0]) == pytest.approx(0.368, abs=0.01) and float(w[1, 0]) == pytest.approx(1.649, abs=0.01)
    assert float(w[0, 0]) == pytest.approx(math.exp(-1.0), rel=1e-6)
    masked = importance_weight(old, rollout, mask, "token", "mask", cap=2.0, cap_low=0.5)
    assert not masked[0].any() and masked[1].tolist() == pytest.approx([math.exp(0.5)] * 5, rel=1e-6)
    no_cap = importance_weight(old, rollout, mask, "token", "mask", cap=math.inf, cap_low=0.5)  # TRL clip_max=None
    assert torch.equal(no_cap, masked)
    lp = torch.full((2, 5), -2.0, requires_grad=True)
    _, m = ppo_loss(lp, old, torch.ones(2, 5), mask, 10, is_weight_BT=masked)
    assert m["ppo/is_masked_frac"] == 0.5
    # Sequence level: the first row's ratio exp(-5) and the second's exp(2.5) both leave [0.5, 2]: both rows masked.
    seq = importance_weight(old, rollout, mask, "sequence", "mask", cap=2.0, cap_low=0.5)
    assert not seq.any()
    seq = importance_weight(old, rollout, mask, "sequence", "truncate", cap=2.0, cap_low=0.5)
    assert seq.tolist() == [[0.5] * 5, [2.0] * 5]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_zero_mask_gives_zero_loss_and_gradient(mode, level):
    nan_pad = torch.full((2, 3), float("nan"))
    for est in ("k1", "k2", "k3"):
        lp = torch.full((2, 3), -math.inf).requires_grad_(True)
        loss, m = ppo_loss(lp, nan_pad, nan_pad, torch.zeros(2, 3), 0, entropy_BT=nan_pad, entropy_coef=0.01,
                           ref_logprobs_BT=nan_pad, kl_coef=0.1, is_weight_BT=nan_pad, loss_agg=mode, total_sequences=0,
                           norm_tokens=8, importance_level=level, kl_estimator=est)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))
        assert all(v == 0.0 for v in m.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_zero_advantages_give_zero_policy_loss(mode):
    """Equal rewards -> A = 0 everywhere: no policy gradient in any mode, even with ratios far from 1."""
    lp = torch.tensor([[-1.0, -2.0, -0.1]], requires_grad=True)
    loss, _ = ppo_loss(lp, torch.tensor([[-3.0, 0.0, -50.0]]), torch.zeros(1, 3), torch.ones(1, 3), 3, loss_agg=mode,
                       total_sequences=1, norm_tokens=4)
    loss.backward()
    assert loss.item() == 0.0 and not lp.grad.any()


def test_bad_options_raise_clear_errors():
    lp, ones = torch.zeros(2, 3), torch.ones(2, 3)
    bad = [
        (dict(loss_agg="seq-mean"), "loss_agg"),
        (dict(importance_level="turn"), "importance_level"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(loss_agg="seq-mean-token-mean"), "total_sequences"),
        (dict(loss_agg="seq-mean-token-sum", total_sequences=1), "total_sequences=1.0 is smaller than this micro-batch's 2"),
        (dict(loss_agg="seq-mean-token-sum-norm", total_sequences=2), "norm_tokens"),
        (dict(loss_agg="seq-mean-token-sum-norm", total_sequences=2, norm_tokens=0), "norm_tokens > 0"),
        (dict(clip_c=1.0), "dual-clip"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            ppo_loss(lp, lp, ones, ones, 6, **kwargs)
    assert float(ppo_loss(lp, lp, ones, ones, 6, clip_c=None)[0]) == pytest.approx(-1.0)
    for kwargs, match in ((dict(level="row"), "level"), (dict(mode="clip"), "mode"), (dict(cap=0.0), "cap"),
                          (dict(cap=2.0, cap_low=2.0), "cap_low"), (dict(cap_low=-0.1), "cap_low")):
        with pytest.raises(ValueError, match=match):
            importance_weight(lp, lp, ones, **kwargs)
    with pytest.raises(ValueError, match="one shape"):
        importance_weight(lp, lp, torch.ones(2, 2))
