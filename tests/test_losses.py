import math

import pytest
import torch

from unirl_pl.group_stats import group_advantages, zero_std_fraction
from unirl_pl.losses import AGGREGATIONS, aggregation_units, flow_grpo_loss, k3_kl, token_policy_loss


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


def test_token_policy_loss_masks_padding_and_adds_kl():
    lp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    out = token_policy_loss(lp, lp.clone(), adv, mask, ref_logp=lp.clone(), beta=0.5)
    # token-level: (-1 -1 +1) / 3 real tokens
    assert float(out.pg_loss) == pytest.approx(-1 / 3)
    assert float(out.kl) == 0.0
    garbage = lp.clone()
    garbage[0, 2] = 50.0  # a padded position must not matter
    out2 = token_policy_loss(garbage, lp.clone(), adv, mask, ref_logp=lp.clone(), beta=0.5)
    assert float(out2.loss) == pytest.approx(float(out.loss))
    shifted = token_policy_loss(lp, lp.clone(), adv, mask, ref_logp=lp - 0.5, beta=0.5)
    assert float(shifted.kl) > 0 and float(shifted.loss) > float(out.loss)


# The token loss's three aggregations on one batch where each gives its own number. Rows: 3 real tokens with
# log-ratios (0.25, 0.05, -0.15) and advantage 1; 1 real token with log-ratio 0.4 and advantage 2; no real token
# (advantage 5, which would move every mean if the empty row counted). Clip 0.3 on both sides: only the
# token ratio e^0.4 = 1.49 clips (to 1.3, its advantage positive: the high side). The reference sits at
# per-token offsets, so a token mean and a per-row mean of the KL differ too.
_LOG_RATIO = [[0.25, 0.05, -0.15], [0.4, 0.0, 0.0], [0.0, 0.0, 0.0]]
_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
_REF_OFFSET = [[0.1, -0.3, 0.5], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]]
_ADV = [1.0, 2.0, 5.0]


def _k3(offset: float) -> float:
    return math.exp(offset) - offset - 1


def _mode(aggregation: str):
    old = torch.full((3, 3), -1.0)
    logp = old + torch.tensor(_LOG_RATIO)
    mask = torch.tensor(_MASK, dtype=torch.bool)
    ref = logp + torch.tensor(_REF_OFFSET)
    return token_policy_loss(
        logp, old, torch.tensor(_ADV), mask, ref_logp=ref, eps_low=0.3, eps_high=0.3, beta=0.5, aggregation=aggregation
    )


# The per-token KL of the two rows with real tokens, from the reference's offsets.
_KL_ROW0 = [_k3(d) for d in _REF_OFFSET[0]]
_KL_ROW1 = [_k3(_REF_OFFSET[1][0])]


def test_token_mean_averages_every_real_token_of_the_batch():
    out = _mode("token_mean")
    terms = [-math.exp(0.25), -math.exp(0.05), -math.exp(-0.15), -2 * 1.3]
    assert float(out.pg_loss) == pytest.approx(sum(terms) / 4)
    assert float(out.kl) == pytest.approx(sum(_KL_ROW0 + _KL_ROW1) / 4)
    assert float(out.loss) == pytest.approx(sum(terms) / 4 + 0.5 * sum(_KL_ROW0 + _KL_ROW1) / 4)
    assert float(out.clip_frac_high) == pytest.approx(1 / 4) and float(out.clip_frac_low) == 0.0
    # The ratio statistics are over real tokens.
    assert float(out.ratio_min) == pytest.approx(math.exp(-0.15))
    assert float(out.ratio_max) == pytest.approx(math.exp(0.4))
    assert float(out.ratio_mean) == pytest.approx(
        (math.exp(0.25) + math.exp(0.05) + math.exp(-0.15) + math.exp(0.4)) / 4
    )


def test_sequence_mean_averages_each_rows_token_mean_over_the_rows_with_a_token():
    out = _mode("sequence_mean")
    row0 = (-math.exp(0.25) - math.exp(0.05) - math.exp(-0.15)) / 3
    assert float(out.pg_loss) == pytest.approx((row0 - 2 * 1.3) / 2)
    assert float(out.kl) == pytest.approx((sum(_KL_ROW0) / 3 + _KL_ROW1[0]) / 2)
    assert float(out.clip_frac_high) == pytest.approx((0 + 1) / 2)
    # The ratio is still per token: its statistics too.
    assert float(out.ratio_min) == pytest.approx(math.exp(-0.15))
    assert float(out.ratio_max) == pytest.approx(math.exp(0.4))


def test_sequence_ratio_clips_one_geometric_mean_ratio_per_row():
    out = _mode("sequence_ratio")
    # Row 0's geometric mean ratio is exp(mean(0.25, 0.05, -0.15)) = e^0.05 (inside the clip range); row 1's
    # is e^0.4, clipped to 1.3.
    assert float(out.pg_loss) == pytest.approx((-1.0 * math.exp(0.05) - 2 * 1.3) / 2)
    assert float(out.kl) == pytest.approx((sum(_KL_ROW0) / 3 + _KL_ROW1[0]) / 2)
    assert float(out.clip_frac_high) == pytest.approx(1 / 2)
    assert float(out.ratio_min) == pytest.approx(math.exp(0.05)) and float(out.ratio_max) == pytest.approx(
        math.exp(0.4)
    )
    assert float(out.ratio_mean) == pytest.approx((math.exp(0.05) + math.exp(0.4)) / 2)


def test_sequence_ratio_weights_a_row_by_the_geometric_mean_of_its_tokens_weights():
    logp, old = torch.zeros(2, 2), torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    weights = torch.tensor([[4.0, 0.25], [3.0, 100.0]])  # geometric means 1 and 3 (the padded 100 unused)
    out = token_policy_loss(logp, old, torch.ones(2), mask, aggregation="sequence_ratio", is_weights=weights)
    assert float(out.pg_loss) == pytest.approx(-(1.0 + 3.0) / 2)
    # Per token, the same weights are an arithmetic mean over the real tokens.
    per_token = token_policy_loss(logp, old, torch.ones(2), mask, is_weights=weights)
    assert float(per_token.pg_loss) == pytest.approx(-(4.0 + 0.25 + 3.0) / 3)


def test_the_three_aggregations_differ_and_an_unknown_one_is_refused():
    losses = {mode: float(_mode(mode).pg_loss) for mode in AGGREGATIONS}
    assert len(set(losses.values())) == 3, losses
    mask = torch.tensor(_MASK, dtype=torch.bool)
    assert torch.equal(aggregation_units(mask, "token_mean"), mask)
    assert aggregation_units(mask, "sequence_mean").tolist() == aggregation_units(mask, "sequence_ratio").tolist()
    assert aggregation_units(mask, "sequence_ratio").tolist() == [True, True, False]
    with pytest.raises(ValueError, match="aggregation must be one of"):
        _mode("sum")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_global_std_uses_the_std_given_for_all_ranks():
    r = torch.tensor([0.0, 2.0])
    g = torch.tensor([0, 0])
    assert torch.allclose(
        group_advantages(r, g, global_std=True, batch_std=4.0), torch.tensor([-1.0, 1.0]) / (4.0 + 1e-4)
    )
