"""The sampler against the Flow-GRPO formulas, written out independently here in float64."""

import math

import pytest
import torch

from unirl_pl.sampling import flow_kl, flow_sde_step_with_logprob, flow_sigmas, ode_step


def reference_step(x, v, s, s_next, sigma_max, a, x_next):
    """The Flow-GRPO formulas, elementwise in float64, for one sample with scalar sigmas."""
    x, v, x_next = x.double(), v.double(), x_next.double()
    dt = s_next - s
    std = math.sqrt(s / (1 - (sigma_max if s == 1 else s))) * a
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    scale = std * math.sqrt(-dt)
    lp = -((x_next - mean) ** 2) / (2 * scale**2) - math.log(scale) - math.log(math.sqrt(2 * math.pi))
    return mean, lp.mean(), std


@pytest.mark.parametrize("step", [0, 1, 4, 8])
def test_sde_step_matches_formula_including_sigma_one(step):
    g = torch.Generator().manual_seed(step)
    sigmas = flow_sigmas(10, shift=3.0)
    s, s_next, sigma_max = float(sigmas[step]), float(sigmas[step + 1]), float(sigmas[1])
    x, v = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    x_next, logp, mean, std = flow_sde_step_with_logprob(x, v, s, s_next, sigma_max=sigma_max, generator=g)
    assert torch.isfinite(logp).all() and torch.isfinite(x_next).all()
    for i in range(3):
        ref_mean, ref_lp, ref_std = reference_step(x[i], v[i], s, s_next, sigma_max, 0.7, x_next[i])
        assert torch.allclose(mean[i].double(), ref_mean, atol=1e-6)
        assert abs(float(logp[i]) - float(ref_lp)) < 1e-5 * max(1.0, abs(float(ref_lp)))
        assert abs(float(std.flatten()[0]) - ref_std) < 1e-6


def test_sigma_one_step_is_finite():
    sigmas = flow_sigmas(4)
    x = torch.randn(2, 3, 4, 4)
    out, logp, mean, std = flow_sde_step_with_logprob(
        x, torch.randn_like(x), 1.0, float(sigmas[1]), sigma_max=float(sigmas[1])
    )
    assert torch.isfinite(out).all() and torch.isfinite(logp).all() and torch.isfinite(std).all()


def test_per_sample_sigma_tensors_equal_scalar_calls():
    sigmas = flow_sigmas(8)
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    steps = [0, 3, 6]
    s = torch.tensor([float(sigmas[i]) for i in steps])
    sn = torch.tensor([float(sigmas[i + 1]) for i in steps])
    target = torch.randn_like(x)
    _, lp, mean, _ = flow_sde_step_with_logprob(x, v, s, sn, sigma_max=float(sigmas[1]), prev_sample=target)
    for row, i in enumerate(steps):
        _, lp1, mean1, _ = flow_sde_step_with_logprob(
            x[row : row + 1],
            v[row : row + 1],
            float(sigmas[i]),
            float(sigmas[i + 1]),
            sigma_max=float(sigmas[1]),
            prev_sample=target[row : row + 1],
        )
        assert torch.allclose(lp[row], lp1[0], atol=1e-6)
        assert torch.allclose(mean[row], mean1[0], atol=1e-6)


def test_noise_level_zero_is_the_euler_step():
    x, v = torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5)
    out, logp, _, _ = flow_sde_step_with_logprob(x, v, 0.6, 0.5, sigma_max=0.9, noise_level=0.0)
    assert torch.allclose(out, x + (0.5 - 0.6) * v, atol=1e-7)
    assert torch.equal(out, ode_step(x, v, 0.6, 0.5))
    assert torch.equal(logp, torch.zeros(2))


def test_logprob_equals_gaussian_density():
    """Re-scoring a given x_next equals torch.distributions.Normal's log-density, averaged."""
    x, v, target = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    s, sn = 0.7, 0.6
    _, logp, mean, std = flow_sde_step_with_logprob(x, v, s, sn, sigma_max=0.9, prev_sample=target)
    dist = torch.distributions.Normal(mean.double(), (std * math.sqrt(s - sn)).double().expand_as(mean))
    expected = dist.log_prob(target.double()).mean(dim=(1, 2, 3))
    assert torch.allclose(logp.double(), expected, atol=1e-5)


def test_sampled_step_has_the_stated_noise_scale():
    x = torch.zeros(4000, 1, 1, 1)
    out, _, mean, std = flow_sde_step_with_logprob(
        x, torch.zeros_like(x), 0.5, 0.4, sigma_max=0.9, generator=torch.Generator().manual_seed(0)
    )
    expected = float(std.flatten()[0]) * math.sqrt(0.1)
    assert abs(float((out - mean).std()) - expected) / expected < 0.05


def test_per_sample_generators_make_noise_independent_of_batch():
    x, v = torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 4, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    batched, *_ = flow_sde_step_with_logprob(x, v, 0.5, 0.4, sigma_max=0.9, generator=gens)
    alone, *_ = flow_sde_step_with_logprob(
        x[2:], v[2:], 0.5, 0.4, sigma_max=0.9, generator=[torch.Generator().manual_seed(2)]
    )
    assert torch.equal(batched[2], alone[0])


def test_kl_zero_for_equal_means_and_positive_otherwise():
    mean = torch.randn(2, 3, 4, 4)
    std = torch.full((2, 1, 1, 1), 0.3)
    assert torch.equal(flow_kl(mean, mean, std), torch.zeros(2))
    kl = flow_kl(mean, mean + 0.1, std)
    assert torch.allclose(kl, torch.full((2,), 0.01 / (2 * 0.09)), atol=1e-6)


def test_schedule_and_bad_inputs():
    s = flow_sigmas(4)
    assert s[0] == 1 and s[-1] == 0 and len(s) == 5
    assert float(flow_sigmas(4, shift=3.0)[2]) > 0.5
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(0)
    with pytest.raises(ValueError, match="sigma must be"):
        flow_sde_step_with_logprob(torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(3), 0.5, sigma_max=0.9)


# ------------------------------------------------------------------ counter-based token draws
def test_gumbel_draws_follow_the_softmax():
    from unirl_pl.seeding import gumbel_argmax, sample_keys

    n = 20_000
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0, -3.0, 0.2, 0.7]])
    tokens = gumbel_argmax(logits.expand(n, -1), sample_keys(0, list(range(n)), [0] * n, 0), position=3)
    freq = torch.bincount(tokens, minlength=8).double() / n
    # 4.5 standard errors of the largest probability's frequency (p~0.4): a wrong sampler is off by far more.
    assert (freq - logits.softmax(-1)[0].double()).abs().max() < 0.016


def test_gumbel_draws_do_not_depend_on_the_batch_and_respect_top_k():
    from unirl_pl.seeding import gumbel_argmax, sample_keys

    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 10:] = float("-inf")  # what top-k leaves
    keys = sample_keys(7, [3, 3, 4, 5, 6, 7], [0, 1, 0, 0, 0, 0], 0)
    batched = gumbel_argmax(logits, keys, position=5)
    alone = torch.cat([gumbel_argmax(logits[i : i + 1], keys[i : i + 1], position=5) for i in range(6)])
    assert torch.equal(batched, alone) and bool((batched < 10).all())
    shuffled = torch.tensor([5, 0, 3, 1, 4, 2])
    assert torch.equal(gumbel_argmax(logits[shuffled], keys[shuffled], 5), batched[shuffled])
    later = torch.stack([gumbel_argmax(logits, keys, p) for p in range(20)])
    assert len({tuple(row.tolist()) for row in later}) > 1, "each position draws new noise"
