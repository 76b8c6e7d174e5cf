import pytest
import torch

from unirl_pl.group_stats import group_advantages, zero_std_fraction
from unirl_pl.losses import flow_grpo_loss, grpo_token_loss, k3_kl


def test_group_advantages_normalize_within_groups():
    r = torch.tensor([1.0, 3.0, 10.0, 10.0, 0.0, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    a = group_advantages(r, g)
    assert torch.allclose(a, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-3)
    assert zero_std_fraction(r, g) == pytest.approx(1 / 3)
    # Ids need not be contiguous: only the groups present count (0 and 5 here; 5 is flat).
    assert zero_std_fraction(torch.tensor([0.0, 1.0, 2.0, 2.0]), torch.tensor([0, 0, 5, 5])) == 0.5
    assert zero_std_fraction(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0])) == 0.0, "NaN is not flat"


def test_group_advantages_global_std_and_clip():
    r = torch.tensor([0.0, 1.0, 0.0, 100.0])
    g = torch.tensor([0, 0, 1, 1])
    a = group_advantages(r, g, global_std=True)
    std = r.std(unbiased=False)
    assert torch.allclose(a, torch.tensor([-0.5, 0.5, -50.0, 50.0]) / (std + 1e-4), atol=1e-5)
    clipped = group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), clip_max=1.5)
    assert float(clipped.max()) == pytest.approx(1.5)


def test_ppo_loss_at_ratio_one_is_minus_mean_advantage():
    adv = torch.tensor([1.0, -2.0, 0.5])
    lp = torch.tensor([-1.0, -2.0, -3.0])
    out = flow_grpo_loss(lp, lp.clone(), adv)
    assert float(out.pg_loss) == pytest.approx(-float(adv.mean()))
    assert float(out.clip_frac) == 0.0 and float(out.ratio_mean) == 1.0


def test_ppo_clipping_engages_outside_the_band():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.5])).requires_grad_()
    out = flow_grpo_loss(new, old, torch.tensor([1.0, -1.0]), clip_eps=0.2)
    # positive advantage above 1+eps and negative advantage below 1-eps are both clipped: no gradient
    out.loss.backward()
    assert torch.equal(new.grad, torch.zeros(2))
    assert float(out.clip_frac_high) == 0.5 and float(out.clip_frac_low) == 0.5
    assert float(out.pg_loss) == pytest.approx((-1.2 + 0.8) / 2)
    inside = torch.log(torch.tensor([1.1])).requires_grad_()
    out = flow_grpo_loss(inside, torch.zeros(1), torch.tensor([1.0]), clip_eps=0.2)
    out.loss.backward()
    assert float(inside.grad) == pytest.approx(-1.1)


def test_k3_is_zero_when_policy_equals_reference_and_positive_otherwise():
    lp = torch.randn(4, 5)
    assert torch.equal(k3_kl(lp, lp), torch.zeros(4, 5))
    assert (k3_kl(lp, lp + 0.3) > 0).all()


def test_grpo_token_loss_masks_padding_and_adds_kl():
    lp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    out = grpo_token_loss(lp, lp.clone(), adv, mask, ref_logp=lp.clone(), beta=0.5)
    # token-level: (-1 -1 +1) / 3 real tokens
    assert float(out.pg_loss) == pytest.approx(-1 / 3)
    assert float(out.kl) == 0.0
    garbage = lp.clone()
    garbage[0, 2] = 50.0  # a padded position must not matter
    out2 = grpo_token_loss(garbage, lp.clone(), adv, mask, ref_logp=lp.clone(), beta=0.5)
    assert float(out2.loss) == pytest.approx(float(out.loss))
    shifted = grpo_token_loss(lp, lp.clone(), adv, mask, ref_logp=lp - 0.5, beta=0.5)
    assert float(shifted.kl) > 0 and float(shifted.loss) > float(out.loss)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_global_std_uses_the_std_given_for_all_ranks():
    r = torch.tensor([0.0, 2.0])
    g = torch.tensor([0, 0])
    assert torch.allclose(
        group_advantages(r, g, global_std=True, batch_std=4.0), torch.tensor([-1.0, 1.0]) / (4.0 + 1e-4)
    )
