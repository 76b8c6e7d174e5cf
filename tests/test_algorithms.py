"""Algorithms as parts: each algorithm's math against hand-computed values or its reference formula in
float64, its rollout record (what it records, reproducibly and independently of the batch), the C2 identity
it states passing bit for bit, and a fault injected into its own recompute caught by the gate.

The module-level tests build the tiny recipe once per algorithm on a 4-step schedule (about 2 s each).
"""

from __future__ import annotations

import importlib
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import JOINT, ROOT, TINY
from unirl_pl.algorithms import DAPO, GSPO, DiffusionNFT, FlowCPS, FlowGRPO, FlowGRPOFast, MixGRPO, TokenGRPO
from unirl_pl.algorithms.flow_grpo_fast import STREAM_WINDOW
from unirl_pl.callbacks import InterleaveParityCheck, LogProbIdentityCheck
from unirl_pl.callbacks.c2 import LogProbIdentityError
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.group_stats import informative_groups
from unirl_pl.loops import RolloutConfig
from unirl_pl.losses import grpo_guard_loss, nft_loss, optimality_probability, token_policy_loss
from unirl_pl.records import DiTRecord, FlowPointsRecord
from unirl_pl.sampling import compress_tail, cps_step_with_logprob, dpm_solver_2m_step, flow_sigmas, flow_x0, ode_step

OVERLAYS = ROOT / "recipes" / "algorithms"
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
FAST = ["--model.rollout.num_steps=4", "--model.generator_algorithm.init_args.sde_window=[0,2]"]


# ------------------------------------------------------------------ pure math


def test_cps_step_matches_the_reference_formula_in_float64():
    torch.manual_seed(0)
    x, v = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    s, s_next, a = torch.tensor([1.0, 0.7, 0.4]), torch.tensor([0.85, 0.5, 0.1]), 0.7
    prev, logp, mean, std = cps_step_with_logprob(
        x, v, s, s_next, noise_level=a, generator=torch.Generator().manual_seed(1)
    )
    # The reference (Flow-GRPO sde_type="cps") written out in float64.
    xd, vd, sd, snd = x.double(), v.double(), s.double()[:, None, None, None], s_next.double()[:, None, None, None]
    std_ref = snd * math.sin(a * math.pi / 2)
    mean_ref = (xd - sd * vd) * (1 - snd) + (xd + vd * (1 - sd)) * torch.sqrt(snd**2 - std_ref**2)
    logp_ref = -((prev.double() - mean_ref) ** 2).mean(dim=(1, 2, 3))
    assert (mean.double() - mean_ref).abs().max() <= 1e-6 and (logp.double() - logp_ref).abs().max() <= 1e-6
    assert (std.double().flatten() - std_ref.flatten()).abs().max() <= 1e-7
    noise = (prev.double() - mean_ref) / std_ref
    assert abs(float(noise.mean())) < 0.2 and abs(float(noise.std()) - 1) < 0.2, "x' = mean + std * N(0, 1)"
    # Re-scoring the drawn sample gives the same log-prob; another sample scores lower.
    _, again, _, _ = cps_step_with_logprob(x, v, s, s_next, noise_level=a, prev_sample=prev)
    _, worse, _, _ = cps_step_with_logprob(x, v, s, s_next, noise_level=a, prev_sample=prev + 0.5)
    assert torch.equal(again, logp) and (worse < logp).all()


def test_cps_preserves_the_noise_coefficient_and_is_ddim_at_noise_level_zero():
    torch.manual_seed(0)
    x0, x1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    s, s_next = 0.8, 0.5
    x, v = (1 - s) * x0 + s * x1, x1 - x0  # a perfect velocity on the straight path
    prev, logp, mean, std = cps_step_with_logprob(x, v, s, s_next, noise_level=0.0)
    assert torch.allclose(mean, (1 - s_next) * x0 + s_next * x1, atol=1e-6) and torch.equal(prev, mean)
    assert torch.equal(logp, torch.zeros(2)) and float(std.max()) == 0.0
    # With noise: the x1 coefficient and the std stay on the circle of radius sigma_next.
    _, _, mean, std = cps_step_with_logprob(x, v, s, s_next, noise_level=0.6)
    coef = (mean - (1 - s_next) * x0).flatten() / x1.flatten()
    assert torch.allclose(coef**2 + float(std.flatten()[0]) ** 2, torch.full_like(coef, s_next**2), atol=1e-5)


def _velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A fixed nonlinear stand-in for a flow model: channel mixing through tanh plus a sigma term."""
    weight = torch.linspace(-0.4, 0.4, 9).reshape(3, 3)
    return torch.tanh(torch.einsum("ij,bjhw->bihw", weight, x)) + 0.5 * sigma


def test_dpm_solver_2m_matches_diffusers_multistep_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        solver_order=2,
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(8)
    sigmas = scheduler.sigmas.double()
    start = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    theirs, ours, x0_prev = start.clone(), start.clone(), None
    for i, t in enumerate(scheduler.timesteps):
        theirs = scheduler.step(_velocity(theirs, float(sigmas[i])), t, theirs).prev_sample
        x0 = flow_x0(ours, _velocity(ours, float(sigmas[i])), float(sigmas[i]))
        ours = dpm_solver_2m_step(ours, x0, sigmas[i], sigmas[i + 1], x0_prev, sigmas[i - 1] if i else None)
        x0_prev = x0
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=0, msg=f"step {i}")


def test_dpm_solver_2m_first_order_is_euler_and_the_history_matters():
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    s, s_next = torch.tensor([0.8, 0.6], dtype=torch.float64), torch.tensor([0.7, 0.0], dtype=torch.float64)
    v = _velocity(x, 0.8)
    x0 = flow_x0(x, v, s)
    torch.testing.assert_close(dpm_solver_2m_step(x, x0, s, s_next), ode_step(x, v, s, s_next), atol=1e-6, rtol=0)
    prev = x0 + 0.1
    second = dpm_solver_2m_step(x, x0, s, s_next, prev, torch.tensor([0.9, 0.7], dtype=torch.float64))
    assert (second[0] - ode_step(x, v, s, s_next)[0]).abs().max() > 1e-3, "sample 0: a second-order correction"
    torch.testing.assert_close(second[1], x0[1], atol=1e-6, rtol=0)  # into sigma' = 0: first order, x0
    # After sigma_prev = 1 (lambda = -inf) the correction vanishes rather than turning into NaN.
    after_one = dpm_solver_2m_step(x, x0, s, s_next, prev, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(after_one, dpm_solver_2m_step(x, x0, s, s_next), atol=0, rtol=0)


def test_compress_tail_keeps_the_head_and_thins_the_tail_like_mix_grpo():
    sigmas = flow_sigmas(10, shift=3.0)
    assert torch.equal(compress_tail(sigmas, 4, 1.0), sigmas)
    thinned = compress_tail(sigmas, 4, 0.5)  # int(7 * 0.5) = 3 points: steps 4, 7 and 10
    assert torch.equal(thinned, torch.cat([sigmas[:4], sigmas[[4, 7, 10]]]))
    # MixGRPO's construction: an even time grid from step 4's time to 0, shifted as SD3 does.
    times = torch.linspace(float(torch.linspace(1, 0, 11, dtype=torch.float64)[4]), 0, 3, dtype=torch.float64)
    torch.testing.assert_close(thinned[4:], 3.0 * times / (1 + 2.0 * times), atol=1e-12, rtol=0)
    assert compress_tail(sigmas, 8, 0.1).tolist() == [*sigmas[:8].tolist(), float(sigmas[8]), 0.0], "2 points"
    between = compress_tail(sigmas, 0, 0.5)  # 5 points at steps 0, 2.5, 5, 7.5, 10
    assert between[1] == pytest.approx(float(sigmas[2] + sigmas[3]) / 2) and between[2] == sigmas[5]
    assert between[-1] == 0.0 and len(between) == 5
    with pytest.raises(ValueError, match="keep"):
        compress_tail(sigmas, 4, 0.0)


def test_grpo_guard_ratio_is_centred_and_reweighted_per_step():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.5, -1.0])
    mean = torch.zeros(2, 1, 2, 2, requires_grad=True)
    old_mean = torch.full((2, 1, 2, 2), 0.3)
    scale, dt, adv = torch.tensor([0.5, 0.2]), torch.tensor([-0.25, -0.1]), torch.tensor([1.0, -1.0])
    out = grpo_guard_loss(logp, old, adv, mean, old_mean, scale, dt, clip_eps=10.0)
    bias = torch.tensor([0.09 / (2 * 0.25), 0.09 / (2 * 0.04)])
    ratio = torch.exp((logp.detach() - old + bias) * scale)
    assert torch.allclose(
        out.pg_loss,
        (-adv * ratio / 0.25 * torch.tensor([1.0, 0.0]) + -adv * ratio / 0.1 * torch.tensor([0.0, 1.0])).sum() / 2,
    )
    # Unchanged means: the bias is 0 and the ratio is exp((logp - old) * scale).
    same = grpo_guard_loss(logp, old, adv, old_mean, old_mean, scale, dt, clip_eps=10.0)
    assert torch.allclose(same.ratio_mean, torch.exp((logp.detach() - old) * scale).mean())
    # Clipped like PPO: far outside the band, a positive advantage gets no gradient.
    far = grpo_guard_loss(logp, old - 100, torch.tensor([1.0, 1.0]), old_mean, old_mean, scale, dt, clip_eps=0.1)
    far.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2)) and float(far.clip_frac_high) == 1.0


def test_token_policy_loss_clip_higher_and_aggregation_by_hand():
    logp = torch.log(torch.tensor([[1.25, 0.9, 1.0], [1.5, 1.0, 1.0]]))
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    # Symmetric 0.2: the ratio 1.25 is clipped to 1.2, 1.5 to 1.2; clip-higher 0.28 keeps 1.25, clips 1.5 to 1.28.
    sym = token_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    high = token_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert float(sym.pg_loss) == pytest.approx(-(1.2 + 0.9 + 1.2) / 3)
    assert float(high.pg_loss) == pytest.approx(-(1.25 + 0.9 + 1.28) / 3)
    assert float(high.clip_frac_high) == pytest.approx(1 / 3) and float(sym.clip_frac_high) == pytest.approx(2 / 3)
    seq = token_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="sequence_mean")
    assert float(seq.pg_loss) == pytest.approx(-((1.25 + 0.9) / 2 + 1.28) / 2)
    # The defaults are the project's token GRPO: symmetric 0.2, token mean.
    ref = logp - 0.1
    a = token_policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.3)
    b = token_policy_loss(logp, old, adv, mask, ref_logp=ref, eps_low=0.2, eps_high=0.2, beta=0.3)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.kl, b.kl)
    with pytest.raises(ValueError, match="aggregation"):
        token_policy_loss(logp, old, adv, mask, aggregation="sum")  # type: ignore[arg-type]


def test_gspo_ratio_is_per_sequence_by_hand():
    logp = torch.tensor([[0.1, -0.1, 5.0], [0.3, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    out = token_policy_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.1, aggregation="sequence_ratio")
    # Row 0: geometric mean of exp(0.1), exp(-0.1) is 1 (the masked 5.0 does not count); row 1: exp(0.3)
    # is clipped to 1.1 with a negative advantage: max(-A r, -A 1.1) = r.
    assert float(out.ratio_min) == pytest.approx(1.0) and float(out.ratio_max) == pytest.approx(math.exp(0.3))
    assert float(out.pg_loss) == pytest.approx((-2.0 * 1.0 + math.exp(0.3)) / 2)
    out.loss.backward()
    # d/dlogp of -A * exp(mean): row 0 tokens get -2 * 1 / 2 each; the masked token nothing.
    assert torch.allclose(logp.grad[0], torch.tensor([-0.5, -0.5, 0.0]))
    assert float(out.clip_frac_low) == 0.0 and float(out.clip_frac_high) == 0.0  # the unclipped branch is larger


def test_nft_loss_and_optimality_probability_by_hand():
    assert torch.allclose(
        optimality_probability(torch.tensor([-7.0, -5.0, 0.0, 2.5, 9.0]), 5.0), torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0])
    )
    x0 = torch.tensor([[1.0, -1.0]])
    xt = torch.tensor([[0.5, 0.0]])
    t = torch.tensor([0.5])
    v = torch.tensor([[0.0, 2.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 1.0]])
    out = nft_loss(v, v_old, xt, x0, t, torch.tensor([0.75]), nft_beta=0.5, clip_max=5.0)
    pos, neg = 0.5 * v.detach() + 0.5 * v_old, 1.5 * v_old - 0.5 * v.detach()  # [0, 1.5] and [0, 0.5]
    err_p, err_n = (xt - 0.5 * pos - x0), (xt - 0.5 * neg - x0)  # [-0.5, 0.25] and [-0.5, 0.75]
    w_p, w_n = err_p.abs().mean(), err_n.abs().mean()
    want = 5.0 * (0.75 * (err_p**2).mean() / w_p / 0.5 + 0.25 * (err_n**2).mean() / w_n / 0.5)
    assert float(out.pg_loss) == pytest.approx(float(want), rel=1e-6)
    assert float(out.extras["old_deviation"]) == pytest.approx(0.5)
    # A sure positive (r = 1) pulls the positive policy's x0 prediction onto the sample: v moves towards
    # (xt - x0) / t = [-1, 2] from [0, 2], so the gradient on v[0] is positive (descent lowers it).
    sure = nft_loss(v, v_old, xt, x0, t, torch.tensor([1.0]), nft_beta=0.5)
    sure.loss.backward()
    assert float(v.grad[0, 0]) > 0


def test_mix_grpo_window_slides_with_the_training_step():
    config = RolloutConfig(num_steps=10)
    mix = MixGRPO(window_size=2, steps_per_window=3, stride=2)
    # last start 10 - 1 - 2 = 7 -> positions 0, 2, 4, 6; each held 3 steps; roll back after 6.
    assert [mix.start_at(s, config) for s in range(0, 15, 3)] == [0, 2, 4, 6, 0]
    assert [mix.start_at(s, config) for s in (0, 1, 2, 3)] == [0, 0, 0, 2]
    stay = MixGRPO(window_size=2, steps_per_window=3, stride=2, roll_back=False)
    assert [stay.start_at(s, config) for s in (9, 12, 30)] == [6, 6, 6]
    mix.begin_step(7)
    plan = mix.plan(config, 0, [1, 2], [0, 1])
    assert plan.starts == (4, 4) and plan.size == 2 and mix.describe(config)["sde_steps"] == [4, 5]
    with pytest.raises(ValueError, match="does not fit"):
        MixGRPO(window_size=3, max_start=8).last_start(config)


def test_fast_windows_are_a_function_of_each_sample_seed():
    config = RolloutConfig(num_steps=8)
    fast = FlowGRPOFast(window_size=2)
    ids, idx = [3] * 8 + [5] * 8, list(range(8)) * 2
    starts = fast.starts(config, 0, ids, idx)
    assert all(0 <= s <= 8 - 1 - 2 for s in starts) and len(set(starts)) > 2, "placed at random within [0, 7)"
    assert fast.starts(config, 0, ids, idx) == starts, "reproducible"
    alone = [fast.starts(config, 0, [r], [k])[0] for r, k in zip(ids, idx, strict=True)]
    assert alone == starts, "a sample's window does not depend on its batch"
    assert fast.starts(config, 1, ids, idx) != starts, "the run seed moves them"
    assert STREAM_WINDOW not in (0, 1)
    narrow = FlowGRPOFast(window_size=1, window_range=(2, 4)).starts(config, 0, ids, idx)
    assert set(narrow) == {2, 3}
    with pytest.raises(ValueError, match="must hold"):
        FlowGRPOFast(window_size=2, window_range=(0, 9)).span(config)


def test_nft_old_policy_decay_schedule():
    nft = DiffusionNFT(ema_flat=2, ema_rate=0.1, ema_max=0.25)
    assert [nft.decay(s) for s in range(6)] == [0.0, 0.0, 0.0, pytest.approx(0.1), pytest.approx(0.2), 0.25]
    with pytest.raises(ValueError, match="ema_max"):
        DiffusionNFT(ema_max=1.0)


def test_refiner_algorithms_validate_their_settings():
    with pytest.raises(ValueError, match="aggregation"):
        TokenGRPO(aggregation="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip ranges"):
        GSPO(clip_eps_low=0.0)
    assert DAPO().clip_eps_high == 0.28 and TokenGRPO().clip_eps_high is None
    assert TokenGRPO().aggregation == DAPO().aggregation == "token_mean"


def test_informative_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    # spread: none, std 0.471, none, a single sample has none
    assert informative_groups(rewards, groups).tolist() == [False, True, False, False]
    assert informative_groups(torch.tensor([0.5, 0.5 + 1e-6]), torch.tensor([0, 0])).tolist() == [True]


def test_dapo_dynamic_sampling_keeps_the_first_informative_groups():
    groups = torch.arange(5).repeat_interleave(2)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9, 0.4, 0.1])  # groups 1, 3 and 4 informative
    assert DAPO().train_groups(rewards, groups).tolist() == [False, True, False, True, True]
    assert DAPO(train_groups=2).train_groups(rewards, groups).tolist() == [False, True, False, True, False]
    dapo = DAPO(train_groups=2)
    dapo.train_groups(rewards, groups)
    assert dapo.metrics("llm", type("R", (), {"gen_mask": torch.ones(2, 3)})())["llm/train_groups"] == 2.0
    flat = torch.full((10,), 0.5)
    dapo = DAPO()
    assert dapo.train_groups(flat, groups).all(), "no informative group: train on all, never on nothing"
    metrics = dapo.metrics("llm", type("R", (), {"gen_mask": torch.ones(2, 3)})())
    assert metrics["llm/train_groups"] == 0.0, "the fallback trains on all, but none was informative"
    assert DAPO(dynamic_sampling=False).train_groups(rewards, groups) is None
    assert TokenGRPO().train_groups(rewards, groups) is None and GSPO().train_groups(rewards, groups) is None
    with pytest.raises(ValueError, match="train_groups must be"):
        DAPO(train_groups=0)
    with pytest.raises(ValueError, match="needs dynamic_sampling"):
        DAPO(dynamic_sampling=False, train_groups=2)


# ------------------------------------------------------------------ on the tiny recipe, per algorithm


def build(*overrides: str):
    cli = main(["--config", TINY, *QUIET, *FAST, *overrides], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


def collect(model, dm, prompts=("a red circle", "a blue square"), request_ids=(3, 7)):
    batch = PromptBatch(list(prompts), list(request_ids), seed=dm.seed, layout=dm.layout)
    return model.source.collect(batch, model.device)


def overlay(name: str) -> list[str]:
    return ["--config", str(OVERLAYS / f"{name}.yaml")]


@pytest.fixture(scope="module")
def fast():
    return build(*overlay("flow_grpo_fast"), "--model.generator_algorithm.init_args.window_size=1")


@pytest.fixture(scope="module")
def nft():
    return build(*overlay("diffusion_nft"))


@pytest.mark.slow
def test_fast_records_one_step_per_sample_at_its_own_place_and_c2_holds(fast):
    model, dm = fast
    exp = collect(model, dm)
    rec = exp.records["diffusion_denoise"]
    assert isinstance(rec, DiTRecord) and rec.num_steps == 1 and rec.sigma.shape == (len(exp.prompts), 1)
    sigmas = model.diffusion_denoise.sigmas(4)
    assert torch.equal(rec.sigma[:, 0], sigmas[rec.starts]) and torch.equal(
        rec.sigma_next[:, 0], sigmas[rec.starts + 1]
    )
    assert len(set(rec.starts.tolist())) > 1, "the samples' windows differ"
    stats = LogProbIdentityCheck().check(model, exp)
    assert stats["transformer"]["frac_bitwise_equal"] == 1.0
    InterleaveParityCheck(num_requests=3, profiles=("rollout",)).check(model)


def test_fast_c2_catches_a_recompute_that_ignores_the_per_sample_windows(fast, monkeypatch):
    model, dm = fast
    exp = collect(model, dm)
    rec = exp.records["diffusion_denoise"]
    sigmas = model.diffusion_denoise.sigmas(4)
    # The fault: re-scoring every sample at the first sample's window (as a recompute reading one window would).
    shared = replace(
        rec,
        sigma=sigmas[rec.starts[:1]].expand_as(rec.sigma).clone(),
        sigma_next=sigmas[rec.starts[:1] + 1].expand_as(rec.sigma).clone(),
    )
    exp.records["diffusion_denoise"] = shared
    with pytest.raises(LogProbIdentityError, match="expert 'transformer'"):
        LogProbIdentityCheck().check(model, exp)


def test_mix_grpo_rollout_follows_the_step_and_c2_catches_a_stale_window():
    model, dm = build(
        *overlay("mix_grpo"),
        "--model.generator_algorithm.init_args.steps_per_window=1",
        "--model.generator_algorithm.init_args.window_size=1",
    )
    model.policy.begin_step(0)
    first = collect(model, dm)
    model.policy.begin_step(1)
    second = collect(model, dm)
    assert set(first.records["diffusion_denoise"].starts.tolist()) == {0} and set(
        second.records["diffusion_denoise"].starts.tolist()
    ) == {1}
    LogProbIdentityCheck().check(model, second)
    # The fault: re-scoring step 1's record at step 0's window.
    second.records["diffusion_denoise"] = replace(
        second.records["diffusion_denoise"],
        sigma=first.records["diffusion_denoise"].sigma,
        sigma_next=first.records["diffusion_denoise"].sigma_next,
    )
    with pytest.raises(LogProbIdentityError, match="expert 'transformer'"):
        LogProbIdentityCheck().check(model, second)


def _one_flat_group(prompts, refined, images, **_):
    """Reward: every sample of "a red circle" scores 0.5 (zero spread); the others score by position."""
    rewards = torch.tensor([0.5 if p == "a red circle" else 0.1 * i for i, p in enumerate(prompts)])
    return rewards, {}


def test_dapo_dynamic_sampling_trains_the_refiner_on_informative_groups_and_c2_holds(monkeypatch):
    model, dm = build(*overlay("dapo"))
    monkeypatch.setattr(model.source, "reward", _one_flat_group)
    exp = collect(model, dm)
    record, k = exp.records["ar_decode"], dm.layout.samples_per_prompt
    prompt_of_row = [exp.prompts[int((exp.text_index == r).nonzero()[0])] for r in record.rows.tolist()]
    assert prompt_of_row and set(prompt_of_row) == {"a blue square"}, prompt_of_row
    assert (record.rows // k == 1).all() and len(exp.advantages["ar_decode"]) == len(record.rows)
    assert exp.advantages["ar_decode"].abs().sum() > 0
    # The recompute scores the kept rows only (a smaller batch than the rollout's): within the gate's
    # tolerance, as every refiner recompute (batch variance of float32 kernels).
    assert LogProbIdentityCheck().check(model, exp)["llm"]["max_abs_diff"] <= 1e-5
    # Without dynamic sampling the flat group's refinements stay in the record (advantage 0).
    model.source.refiner_groups = TokenGRPO().train_groups
    every = collect(model, dm).records["ar_decode"]
    assert set((every.rows // k).tolist()) == {0, 1}


def test_lm_record_take_selects_rows_in_order():
    model, dm = build()
    record = collect(model, dm).records["ar_decode"]
    index = torch.tensor([2, 0])
    taken = record.take(index)
    for name in ("input_ids", "attention_mask", "gen_mask", "old_logp", "rows"):
        assert torch.equal(getattr(taken, name), getattr(record, name)[index]), name
    assert taken.prompt_len == record.prompt_len and taken.version == record.version


def test_mix_grpo_flash_records_the_same_window_with_fewer_transformer_calls(monkeypatch):
    calls = {"n": 0}

    def rollout(*overrides: str):
        model, dm = build(*overlay("mix_grpo"), "--model.generator_algorithm.init_args.window_size=1", *overrides)
        velocity = model.diffusion_denoise.velocity

        def counted(*args, **kwargs):
            calls["n"] += 1
            return velocity(*args, **kwargs)

        monkeypatch.setattr(model.diffusion_denoise, "velocity", counted)
        calls["n"] = 0
        exp = collect(model, dm)
        return model, exp, calls["n"]

    _, euler, euler_calls = rollout()
    model, flash, flash_calls = rollout(
        "--model.generator_algorithm.init_args.post_solver=dpm2", "--model.generator_algorithm.init_args.post_keep=0.5"
    )
    # 4 steps, window [0, 1): the tail's 4 points from step 1 thin to 2 (steps 1 and 4), so 2 calls per chunk.
    assert flash_calls * 2 == euler_calls, (flash_calls, euler_calls)
    a, b = euler.records["diffusion_denoise"], flash.records["diffusion_denoise"]
    for name in ("prev", "sample", "old_logp", "sigma", "sigma_next"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(euler.images, flash.images), "the post-window ODE changed"
    assert LogProbIdentityCheck().check(model, flash)["transformer"]["frac_bitwise_equal"] == 1.0
    with pytest.raises(ValueError, match="post_keep"):
        MixGRPO(post_keep=0.5)


def test_cps_records_its_own_step_and_c2_catches_a_recompute_with_the_sde_step():
    model, dm = build(*overlay("cps"))
    exp = collect(model, dm)
    assert exp.records["diffusion_denoise"].kind == "cps" and exp.records["diffusion_denoise"].noise_level == 0.8
    assert LogProbIdentityCheck().check(model, exp)["transformer"]["frac_bitwise_equal"] == 1.0
    exp.records["diffusion_denoise"] = replace(exp.records["diffusion_denoise"], kind="sde")
    with pytest.raises(LogProbIdentityError, match="expert 'transformer'"):
        LogProbIdentityCheck().check(model, exp)
    with pytest.raises(ValueError, match="includes the last step"):
        FlowCPS(sde_window=(2, 4)).window(RolloutConfig(num_steps=4))


def test_nft_records_old_policy_points_and_the_gate_checks_them(nft, monkeypatch):
    model, dm = nft
    algorithm = model.generator_algorithm
    exp = collect(model, dm)
    rec = exp.records["diffusion_denoise"]
    assert isinstance(rec, FlowPointsRecord) and rec.num_points == 3  # int(4 * 0.99)
    assert rec.xt.shape == (len(exp.prompts), 3, *rec.x0.shape[1:])
    stats = LogProbIdentityCheck().check(model, exp)
    assert stats["transformer"]["max_abs_diff"] == 0.0
    # The identity is the OLD policy's: a change of the current weights leaves it intact ...
    params = algorithm.params
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        next(p for p in params if p.abs().sum() == 0).add_(0.05)  # a LoRA B matrix
    try:
        LogProbIdentityCheck().check(model, exp)
        # ... and a recompute that scores the current weights instead of the old policy is caught.
        monkeypatch.setattr(DiffusionNFT, "old_policy", lambda self: nullcontext())
        with pytest.raises(LogProbIdentityError, match="training point"):
            LogProbIdentityCheck().check(model, exp)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


def test_nft_old_policy_swaps_in_and_out_exactly_and_follows_the_decay(nft):
    model, _ = nft
    algorithm = model.generator_algorithm
    current = [p.detach().clone() for p in algorithm.params]
    old = [o.clone() for o in algorithm.old]
    with torch.no_grad():
        for o in algorithm.old:
            o.add_(1.0)
    try:
        with algorithm.old_policy():
            assert all(torch.equal(p, o) for p, o in zip(algorithm.params, algorithm.old, strict=True))
        assert all(torch.equal(p, c) for p, c in zip(algorithm.params, current, strict=True)), "restored exactly"
        state = algorithm.state_dict()
        algorithm.end_step(0)  # decay(1) = 0.001: old <- 0.999 current + 0.001 old ... of the shifted old
        moved = [o.clone() for o in algorithm.old]
        assert all(torch.allclose(m, c + 0.001, atol=1e-6) for m, c in zip(moved, current, strict=True))
        algorithm.load_state_dict(state)
        assert all(torch.equal(o, s) for o, s in zip(algorithm.old, state["old"], strict=True))
    finally:
        with torch.no_grad():
            for o, s in zip(algorithm.old, old, strict=True):
                o.copy_(s)


def test_nft_loss_on_the_record_backpropagates_per_point(nft):
    model, dm = nft
    exp = collect(model, dm)
    terms = []
    out = model.policy.loss("transformer", exp, backward=terms.append)
    assert out.backpropagated and len(terms) == 3 and torch.isfinite(out.loss)
    assert {"old_deviation"} <= out.extras.keys()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="rollout_correction"):
        DiffusionNFT().check_settings(replace(model.losses["transformer"], rollout_correction="tis"))


def test_nft_refuses_guidance():
    with pytest.raises(ValueError, match="guidance"):
        build(*overlay("diffusion_nft"), "--model.rollout.guidance_scale=2.0")


@pytest.mark.slow
def test_every_overlay_names_its_algorithm_and_applies_to_the_main_recipe():
    expected = {
        "flow_grpo": ("generator_algorithm", FlowGRPO),
        "grpo_guard": ("generator_algorithm", FlowGRPO),
        "flow_grpo_fast": ("generator_algorithm", FlowGRPOFast),
        "mix_grpo": ("generator_algorithm", MixGRPO),
        "mix_grpo_flash": ("generator_algorithm", MixGRPO),
        "cps": ("generator_algorithm", FlowCPS),
        "diffusion_nft": ("generator_algorithm", DiffusionNFT),
        "dapo": ("llm_algorithm", DAPO),
        "gspo": ("llm_algorithm", GSPO),
        # As each reference publishes it (tests/test_published_overlays.py checks their values row for row).
        "flow_grpo_published": ("generator_algorithm", FlowGRPO),
        "flow_grpo_fast_published": ("generator_algorithm", FlowGRPOFast),
        "diffusion_nft_published": ("generator_algorithm", DiffusionNFT),
        "dapo_published": ("llm_algorithm", DAPO),
        "gspo_published": ("llm_algorithm", GSPO),
    }
    assert {p.stem for p in Path(OVERLAYS).glob("*.yaml")} == set(expected)
    for name, (key, cls) in expected.items():
        part = yaml.safe_load((OVERLAYS / f"{name}.yaml").read_text())["model"]["init_args"][key]
        module, _, attr = part["class_path"].rpartition(".")
        assert getattr(importlib.import_module(module), attr) is cls, name
        cls(**part.get("init_args", {}))  # its arguments are the class's
    # Through the CLI on the main recipe: the overlay's keys merge, the recipe's others stay (a tiny fit per
    # overlay is tests/test_algorithms_fit.py).
    models = {
        name: main(["--config", JOINT, *overlay(name), *QUIET], run=False).model for name in ("diffusion_nft", "gspo")
    }
    for name, model in models.items():
        assert type(getattr(model, expected[name][0])) is expected[name][1], name
        assert model.losses["transformer"].clip_eps == 1e-4 and model.losses["llm"].clip_eps == 0.2, name
    # gspo keeps the main recipe's generator (its CPS window, a group's shared start noise); DiffusionNFT draws
    # each sample's own start noise, as its reference does (it refuses a shared one).
    assert models["gspo"].generator_algorithm.sde_window == (0, 4) and models["gspo"].rollout_config.shared_start_noise
    assert not models["diffusion_nft"].rollout_config.shared_start_noise
    # gspo leaves the generator's KL weight alone; diffusion_nft sets its own.
    assert (
        models["gspo"].losses["transformer"].beta == 0.004
        and models["diffusion_nft"].losses["transformer"].beta == 1e-4
    )
