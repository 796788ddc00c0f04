"""Token log-probs and dual-clip PPO (spec §5; bad-input cases 3, 4, 6)."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from opsd.credit.policy_loss import entropy_from_logits, ppo_loss, sampler_mismatch_k3, token_logprobs, truncated_is_weight


def test_case6_logprob_uses_temperature_scaled_softmax():
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    assert lp.dtype == torch.float32
    assert lp.item() == pytest.approx(-math.log(1 + math.exp(-2) + math.exp(-4)), abs=1e-6)
    assert lp.item() == pytest.approx(-0.1429, abs=1e-4)
    assert token_logprobs(logits, torch.tensor([[0]])).item() == pytest.approx(-0.4076, abs=1e-4)
    with pytest.raises(ValueError):
        token_logprobs(logits, torch.tensor([[0]]), temperature=0.0)


def test_bf16_logits_are_scored_in_float32():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    lp16 = token_logprobs(logits.bfloat16(), ids)
    ref = token_logprobs(logits.bfloat16().float(), ids)
    assert lp16.dtype == torch.float32 and torch.equal(lp16, ref)


def test_entropy_from_logits():
    ent = entropy_from_logits(torch.zeros(1, 1, 4))
    assert ent.item() == pytest.approx(math.log(4), abs=1e-6)
    ent = entropy_from_logits(torch.tensor([[[0.0, 0.0, -math.inf]]]))
    assert ent.item() == pytest.approx(math.log(2), abs=1e-6)  # a masked vocab entry gives no NaN


def test_ratio_is_one_when_logprobs_equal_old():
    lp = torch.tensor([[-0.3, -1.2, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, m = ppo_loss(lp, lp.detach().clone(), adv, torch.ones(1, 3), total_loss_tokens=3)
    assert m["ppo/ratio_mean"] == 1.0 and m["ppo/ratio_dev_max"] == 0.0 and m["ppo/clip_frac"] == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-1 / 3, 2 / 3, -0.5 / 3])


def test_case3_all_zero_mask_gives_zero_loss_and_gradient():
    lp = torch.tensor([[-1.0, -math.inf, 0.0]], requires_grad=True)  # padding may hold -inf
    old = torch.tensor([[-2.0, -math.inf, float("nan")]])
    loss, m = ppo_loss(lp, old, torch.ones(1, 3), torch.zeros(1, 3), total_loss_tokens=0, entropy_BT=torch.ones(1, 3), entropy_coef=0.01)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 3))
    assert all(v == 0.0 for v in m.values())


def test_masked_padding_never_leaks_nan_into_gradient():
    lp = torch.tensor([[-1.0, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.0, float("nan")]])
    loss, _ = ppo_loss(lp, old, torch.tensor([[2.0, 7.0]]), torch.tensor([[1.0, 0.0]]), total_loss_tokens=1)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert lp.grad.tolist() == [[-2.0, 0.0]]


def test_case4_token_mean_uses_the_minibatch_denominator():
    # A: 2 tokens with loss 1.0 (ratio 1, advantage -1); B: 6 tokens with loss 0.0 (advantage 0).
    lp_a = torch.zeros(1, 2, requires_grad=True)
    lp_b = torch.zeros(1, 6, requires_grad=True)
    total = 8
    loss_a, _ = ppo_loss(lp_a, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), total)
    loss_b, _ = ppo_loss(lp_b, torch.zeros(1, 6), torch.zeros(1, 6), torch.ones(1, 6), total)
    assert (loss_a + loss_b).item() == pytest.approx(0.25)
    assert (loss_a + loss_b).item() != pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_loss_tokens"):
        ppo_loss(lp_b, torch.zeros(1, 6), torch.zeros(1, 6), torch.ones(1, 6), total_loss_tokens=2)


def test_dual_clip_on_negative_advantage_hand_computed():
    # Four tokens, A = -1, ratios 5, 2, 1.1, 0.5:
    #   5   -> max(5, 1.2) = 5, dual clip min(5, 3) = 3 (constant, no gradient)
    #   2   -> max(2, 1.2) = 2 < 3: unclipped, d/dlogp = ratio = 2
    #   1.1 -> max(1.1, 1.1) = 1.1, gradient 1.1
    #   0.5 -> max(0.5, 0.8) = 0.8 (clipped, no gradient)
    ratios = torch.tensor([[5.0, 2.0, 1.1, 0.5]])
    old = torch.full((1, 4), -1.0)
    lp = (old + ratios.log()).clone().requires_grad_(True)
    adv = -torch.ones(1, 4)
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 4), total_loss_tokens=4)
    assert loss.item() == pytest.approx((3.0 + 2.0 + 1.1 + 0.8) / 4, rel=1e-6)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 2.0 / 4, 1.1 / 4, 0.0], abs=1e-6)
    assert m["ppo/dual_clip_frac"] == 0.25
    assert m["ppo/clip_frac"] == 0.25
    assert m["ppo/ratio_dev_max"] == pytest.approx(4.0, rel=1e-6)
    assert m["ppo/ratio_mean"] == pytest.approx((5 + 2 + 1.1 + 0.5) / 4, rel=1e-6)


def test_positive_advantage_is_clipped_above_without_dual_clip():
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[5.0, 0.5]])).requires_grad_(True)
    loss, m = ppo_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), total_loss_tokens=2)
    # ratio 5 -> max(-5, -1.2) = -1.2 (no gradient); ratio 0.5 -> max(-0.5, -0.8) = -0.5
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 2, rel=1e-6)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 2], abs=1e-6)
    assert m["ppo/dual_clip_frac"] == 0.0 and m["ppo/clip_frac"] == 0.5


def test_entropy_bonus_and_kl_terms():
    lp = torch.zeros(1, 2, requires_grad=True)
    ent = torch.tensor([[1.0, 3.0]])
    loss, m = ppo_loss(lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 2, entropy_BT=ent, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * 2.0)
    assert m["ppo/entropy_mean"] == pytest.approx(2.0)
    ref = torch.tensor([[math.log(2.0), 0.0]])
    loss, m = ppo_loss(lp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 2, ref_logprobs_BT=ref, kl_coef=1.0)
    assert loss.item() == pytest.approx((2.0 - math.log(2.0) - 1.0) / 2, rel=1e-6)


def test_truncated_is_weight():
    w = truncated_is_weight(torch.tensor([0.0, -1.0, 100.0]), torch.tensor([-3.0, 0.0, 0.0]))
    assert w.tolist() == pytest.approx([5.0, math.exp(-1.0), 5.0])


def test_truncated_is_weight_exact_values():
    """min(exp(clip(old - rollout, +-20)), cap) (spec §5) at d = 0, ln 10, 30, -30."""
    d = torch.tensor([[0.0, math.log(10.0), 30.0, -30.0]])
    rollout = torch.full_like(d, -2.0)
    w = truncated_is_weight(rollout + d, rollout, cap=5.0)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert w[0, 0].item() == 1.0
    assert w[0, 1].item() == 5.0  # 10 capped at 5
    assert w[0, 2].item() == 5.0
    assert w[0, 3].item() == pytest.approx(math.exp(-20.0), rel=1e-5)  # clipped at -20, not exp(-30)
    big = truncated_is_weight(rollout + d, rollout, cap=1e12)
    assert big[0, 1].item() == pytest.approx(10.0, rel=1e-6)
    assert big[0, 2].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # clipped at +20, not exp(30)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weight(d, d, cap=0.0)


def test_is_weight_scales_each_tokens_gradient_by_exactly_its_weight():
    lp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    weight = truncated_is_weight(torch.tensor([[0.0, math.log(3.0), -1.0]]), torch.zeros(1, 3))  # [1, 3, e^-1]
    plain, _ = ppo_loss(lp, lp.detach().clone(), adv, torch.ones(1, 3), total_loss_tokens=3)
    (g_plain,) = torch.autograd.grad(plain, lp)
    weighted, _ = ppo_loss(lp, lp.detach().clone(), adv, torch.ones(1, 3), total_loss_tokens=3, is_weight_BT=weight)
    (g_weighted,) = torch.autograd.grad(weighted, lp)
    assert g_weighted.tolist()[0] == pytest.approx([-1 / 3, 3 * 2 / 3, -math.exp(-1) * 0.5 / 3], rel=1e-6)
    assert torch.allclose(g_weighted, g_plain * weight, rtol=1e-6, atol=0)
    assert weighted.item() == pytest.approx(-(1.0 - 3 * 2.0 + math.exp(-1) * 0.5) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="is_weight_BT"):
        ppo_loss(lp, lp.detach(), adv, torch.ones(1, 3), 3, is_weight_BT=torch.ones(1, 2))


def test_sampler_mismatch_k3():
    lp = torch.tensor([[-0.3, -1.2, -2.0, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.equal(sampler_mismatch_k3(lp, lp, mask), torch.zeros(1, 4))  # sampler == trainer: 0, NaN padding ignored
    # d = old - sampler = ln 2 and -1: k3 = 2 - 1 - ln 2 and e^-1 - 1 + 1 = e^-1
    k3 = sampler_mismatch_k3(torch.tensor([[math.log(2.0), -1.0, 0.0, 5.0]]), torch.zeros(1, 4), mask)
    assert k3.tolist()[0] == pytest.approx([1.0 - math.log(2.0), math.exp(-1.0), 0.0, 0.0], rel=1e-6)
    assert (k3 >= 0).all()


def test_sdar_loss_value_gate_and_gradient():
    """coef * token-mean(sigmoid(beta (t - sg(s))) (t - s)) over the mini-batch's loss tokens."""
    from opsd.credit.policy_loss import sdar_loss

    logp = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = sdar_loss(logp, teacher, mask, total_loss_tokens=4, coef=0.01, beta=5.0)
    gaps = np.array([0.5, -0.5, 0.0])
    gates = 1 / (1 + np.exp(-5.0 * gaps))
    assert float(loss.detach()) == pytest.approx(0.01 * float((gates * gaps).sum()) / 4, rel=1e-6)
    assert m["sdar/gate_mean"] == pytest.approx(gates.mean(), rel=1e-6)
    loss.backward()
    # d loss / d logp = -coef * gate / N on loss tokens (the gate is stop-gradient), 0 (not NaN) off the mask.
    assert torch.allclose(logp.grad, torch.tensor([[*(-0.01 * gates / 4), 0.0]], dtype=torch.float32), atol=1e-8)


def test_sdar_loss_empty_mask_is_zero():
    from opsd.credit.policy_loss import sdar_loss

    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = sdar_loss(logp, torch.zeros(2, 3), torch.zeros(2, 3), 0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and not logp.grad.any()
