"""The RLHF losses on hand-computed examples."""

import math

import pytest
import torch

from hfplan.executor.engines import losses


def test_policy_loss_hand_computed():
    # ratios 1.5, 0.5, 1.0 against old log-probs of 0; advantages 1, -2, 3; clip 0.2.
    log_probs = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.ones(1, 3)
    out = losses.policy_loss(log_probs, old, adv, mask, clip_ratio=0.2, tokens=3)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(1.0, 1.6) = 1.6 (clipped); token 2: -3.
    assert out.loss.item() == pytest.approx((-1.2 + 1.6 - 3.0) / 3)
    assert out.clip_frac.item() == pytest.approx(2 / 3)
    assert out.approx_kl.item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    out.loss.backward()
    # Clipped tokens pass no gradient; the unclipped one gets -A * ratio / tokens.
    assert log_probs.grad[0].tolist() == pytest.approx([0.0, 0.0, -3.0 / 3])


def test_policy_loss_mask_and_global_token_count():
    log_probs = torch.tensor([[math.log(1.5), math.log(0.5), float("nan")]])
    out = losses.policy_loss(log_probs, torch.zeros(1, 3), torch.tensor([[1.0, -2.0, 3.0]]),
                             torch.tensor([[1, 1, 0]]), clip_ratio=0.2, tokens=4)
    assert out.loss.item() == pytest.approx((-1.2 + 1.6) / 4)
    assert out.clip_frac.item() == pytest.approx(2 / 4)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 1.0, 0.0, 9.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    out = losses.value_loss(values, old, returns, mask, value_clip=0.2, tokens=4)
    # token 0: clipped value 0.7 -> 0.5 * max(1, 1.69); token 1: 0.5 * 1; token 2: clipped 0.2 -> 0.5 * max(0, 0.64);
    # token 3: clipped 0.8 -> 0.5 * max(1, 0.04); token 4 masked.
    expected = (0.5 * 1.69 + 0.5 * 1.0 + 0.5 * 0.64 + 0.5 * 1.0) / 4
    assert out.loss.item() == pytest.approx(expected)
    assert out.clip_frac.item() == pytest.approx(2 / 4)
    out.loss.backward()
    # Where the clipped error wins the clamp saturates: no gradient; elsewhere (v - R) / tokens.
    assert values.grad[0].tolist() == pytest.approx([0.0, 1.0 / 4, 0.0, -1.0 / 4, 0.0])


def test_kl_estimators_hand_computed():
    log_probs = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    assert losses.kl_per_token(log_probs, ref, "k1").item() == pytest.approx(math.log(2))
    assert losses.kl_per_token(log_probs, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert losses.kl_per_token(log_probs, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    same = losses.kl_per_token(ref, ref, "k3")
    assert same.item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        losses.kl_per_token(log_probs, ref, "k4")


def test_entropy_from_logits():
    uniform = torch.zeros(2, 4)
    assert losses.entropy_from_logits(uniform).tolist() == pytest.approx([math.log(4)] * 2)
    skewed = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.25)])
    assert losses.entropy_from_logits(skewed).item() == pytest.approx(1.5 * math.log(2))
    assert losses.entropy_from_logits(skewed + 10).item() == pytest.approx(1.5 * math.log(2))
    assert losses.entropy_from_logits(skewed.to(torch.bfloat16)).dtype == torch.float32


def test_masked_sum_ignores_masked_nan():
    assert losses.masked_sum(torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([1, 0, 1])).item() == 3.0
    assert losses.token_mean(torch.tensor([1.0, 5.0, 2.0]), torch.tensor([1, 0, 1]), tokens=4).item() == 0.75


def test_micro_batch_losses_add_up_to_the_mini_batch_mean():
    torch.manual_seed(0)
    log_probs = torch.randn(4, 5, requires_grad=True)
    old = log_probs.detach() + 0.3 * torch.randn(4, 5)
    adv = torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).long()
    tokens = mask.sum()
    whole = losses.policy_loss(log_probs, old, adv, mask, 0.2, tokens)
    (whole_grad,) = torch.autograd.grad(whole.loss, log_probs)
    parts = [losses.policy_loss(log_probs[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], 0.2, tokens)
             for i in range(4)]
    total = sum(p.loss for p in parts)
    (parts_grad,) = torch.autograd.grad(total, log_probs)
    assert total.item() == pytest.approx(whole.loss.item(), abs=1e-6)
    assert sum(p.clip_frac for p in parts).item() == pytest.approx(whole.clip_frac.item(), abs=1e-6)
    torch.testing.assert_close(parts_grad, whole_grad)
    # The single-process token mean, computed directly.
    surrogate = torch.maximum(-adv * (log_probs - old).exp(), -adv * (log_probs - old).exp().clamp(0.8, 1.2))
    assert whole.loss.item() == pytest.approx(surrogate[mask.bool()].mean().item(), abs=1e-6)


def test_an_on_policy_step_without_old_log_probs_is_the_step_with_them():
    """Reused policy log-probs: the ratio against the current log-probs, detached, has the loss and the
    gradient of the ratio against equal old log-probs (-A * grad log p on every token, no clipping)."""
    from hfplan.hyperparams import Hyperparameters

    torch.manual_seed(1)
    log_probs = torch.randn(3, 4, requires_grad=True)
    entropy = torch.rand(3, 4)
    batch = {"response_mask": (torch.rand(3, 4) > 0.2).long(), "advantages": torch.randn(3, 4),
             "ref_log_probs": torch.randn(3, 4)}
    tokens = batch["response_mask"].sum()
    hp = Hyperparameters(entropy_coef=0.01)
    reused, reused_stats = losses.actor_objective(log_probs, entropy, batch, tokens, hp, use_kl_loss=True)
    (reused_grad,) = torch.autograd.grad(reused, log_probs, retain_graph=True)
    given = batch | {"old_log_probs": log_probs.detach().clone()}
    computed, computed_stats = losses.actor_objective(log_probs, entropy, given, tokens, hp, use_kl_loss=True)
    (computed_grad,) = torch.autograd.grad(computed, log_probs)
    assert reused.item() == computed.item()
    torch.testing.assert_close(reused_grad, computed_grad, atol=0, rtol=0)
    assert reused_stats["clip_frac"].item() == 0.0 and reused_stats["approx_kl"].item() == 0.0
    kl_grad = torch.autograd.grad(hp.kl_loss_coef * reused_stats["kl"], log_probs)[0]
    torch.testing.assert_close(reused_grad - kl_grad, -batch["advantages"] * batch["response_mask"] / tokens)
