"""Classifier-free guidance in the training recompute, and the sampler settings of issue 30 items 4 and 5.

``rollout.detach_uncond`` keeps the unconditional branch out of the gradient: the guided velocity
``v_u + g (v_c - v_u)`` becomes ``v_u.detach() + g (v_c - v_u.detach())``, bit-identical in value (rollout
and the C2 log-prob gate unchanged) with gradient ``g dv_c`` instead of ``(1 - g) dv_u + g dv_c``.
``rollout.guidance_scale_2`` is Wan2.2's guidance of the low-noise expert (``WanPipeline(guidance_scale_2=)``).
A ``rollout.shift`` override recomputes a family pipeline's own scheduler with that shift.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from tests.helpers import ROOT
from tests.pipelines import (
    FLUX_DEV_SCHEDULER,
    make_flux_pipeline,
    make_sd3_pipeline,
    make_wan22_pipeline,
    make_wan_pipeline,
    random_latents,
    with_scheduler,
)
from unirl_pl.algorithms import FlowGRPO, FlowGRPOFast
from unirl_pl.experts import FlowTransformerExpert, TextEncoderExpert
from unirl_pl.generators import ComponentGenerator, load_generator
from unirl_pl.generators.schedule import shifted_config
from unirl_pl.generators.wan import HIGH_NOISE, LOW_NOISE
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.sampling import flow_sigmas

G = 4.5  # SD3.5's guidance: far from 1, so (1 - g) dv_u is no small term


def _perturb_lora(module: torch.nn.Module, seed: int) -> None:
    """Move every trainable (LoRA) weight off its init (B = 0 would leave A without a gradient)."""
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=rng))


def _trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def tiny():
    """The project's own tiny pixel-space generator with a perturbed LoRA, its prompts and the empty prompt."""
    generator = ComponentGenerator(FlowTransformerExpert(in_channels=3), TextEncoderExpert(), vae=None)
    generator.build()
    _perturb_lora(generator, seed=1)
    cond = generator.encode(["a red circle", "a blue square", "a green cat"])
    return generator, cond, generator.encode([""])


def _loop(generator, **settings) -> DiffusionDenoise:
    config = RolloutConfig(num_steps=4, guidance_scale=G, **settings)
    return DiffusionDenoise(generator, config, FlowGRPO(sde_window=(0, 2)))


def _branches(generator, x, sigma, cond, uncond) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v_c, v_u)`` of the loop's own batched forward ([x; x] with [cond; uncond]), with grad."""
    n = x.shape[0]
    s = torch.as_tensor(sigma, dtype=torch.float32).expand(n)
    both = {k: torch.cat([cond[k], v.expand(n, *v.shape[1:])]) for k, v in uncond.items()}
    return generator.velocity(torch.cat([x, x]), torch.cat([s, s]), both).split(n)


def _grad(output: torch.Tensor, weight: torch.Tensor, params: list, retain: bool = False) -> torch.Tensor:
    """The gradient of ``<weight, output>`` with respect to ``params``, flattened into one vector."""
    grads = torch.autograd.grad((weight * output).sum(), params, allow_unused=True, retain_graph=retain)
    return torch.cat(
        [torch.zeros_like(p).flatten() if g is None else g.flatten() for g, p in zip(grads, params, strict=True)]
    )


def _check_cfg_gradients(velocity, generator, cond, uncond, detach: bool) -> None:
    """``velocity`` (the loop's guided velocity) has the gradient the setting states, derived with autograd
    from the two branches: ``g dv_c`` with ``detach``, ``(1 - g) dv_u + g dv_c`` without."""
    params = _trainable(generator)
    x = random_latents(generator.latent_shape, 3, seed=5)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    weight = random_latents(generator.latent_shape, 3, seed=6)
    got = _grad(velocity(x, sigma, cond, uncond), weight, params)
    v_c, v_u = _branches(generator, x, sigma, cond, uncond)
    grad_c, grad_u = _grad(v_c, weight, params, retain=True), _grad(v_u, weight, params)
    want = G * grad_c if detach else (1 - G) * grad_u + G * grad_c
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # The conditional branch alone (its own forward, not inside the guided batch) gives the same g dv_c.
    alone = _grad(generator.velocity(x, sigma, cond), weight, params)
    torch.testing.assert_close(grad_c, alone, rtol=1e-4, atol=1e-5 * float(alone.abs().max()))
    # The two settings differ by (1 - g) dv_u, which is far from negligible here.
    assert float(((1 - G) * grad_u).norm()) > 0.1 * float(want.norm())


# ------------------------------------------------------------------ detach_uncond
def test_detach_uncond_defaults_off_and_changes_no_forward_value(tiny) -> None:
    generator, cond, uncond = tiny
    assert RolloutConfig().detach_uncond is False
    plain, detached = _loop(generator), _loop(generator, detach_uncond=True)
    x = random_latents(generator.latent_shape, 3, seed=2)
    for sigma in (0.7, torch.tensor([0.9, 0.5, 0.2])):
        with torch.no_grad():
            assert torch.equal(plain.velocity(x, sigma, cond, uncond), detached.velocity(x, sigma, cond, uncond))
        # With grad enabled too (the training recompute): the same bits, only the graph differs.
        a, b = plain.velocity(x, sigma, cond, uncond), detached.velocity(x, sigma, cond, uncond)
        assert torch.equal(a, b) and a.requires_grad and b.requires_grad


def test_detach_uncond_recompute_log_probs_are_bitwise_the_rollouts(tiny) -> None:
    """Rollout under either setting records the same steps; each setting's recompute (with grad) gives the
    recorded log-probs exactly, so the C2 gate stays bitwise."""
    generator, cond, uncond = tiny
    plain, detached = _loop(generator), _loop(generator, detach_uncond=True)
    ids = [0, 1, 2]
    _, rec_plain = plain.sample(cond, ids, [0, 0, 0], "rollout", seed=3, uncond=uncond)
    _, rec_detached = detached.sample(cond, ids, [0, 0, 0], "rollout", seed=3, uncond=uncond)
    assert torch.equal(rec_plain.old_logp, rec_detached.old_logp)
    assert torch.equal(rec_plain.sample, rec_detached.sample)
    for step, chunk in rec_plain.steps():
        a, b = chunk
        logp_plain = plain.step_logprob(rec_plain, step, chunk)[0]
        logp_detached = detached.step_logprob(rec_plain, step, chunk)[0]
        assert logp_detached.requires_grad
        assert torch.equal(logp_plain, logp_detached)
        assert torch.equal(logp_detached, rec_plain.old_logp[a:b, step])


@pytest.mark.parametrize("detach", [False, True])
def test_guided_velocity_gradient_is_the_stated_mix_of_the_branches(tiny, detach: bool) -> None:
    generator, cond, uncond = tiny
    loop = _loop(generator, detach_uncond=detach)
    _check_cfg_gradients(loop.velocity, generator, cond, uncond, detach)


def test_the_gradient_check_catches_a_detach_in_the_wrong_place(tiny) -> None:
    """Detaching v_c instead of v_u (or detaching the guided sum) keeps every value but not the gradient:
    the check above must fail on such a velocity, or it would not guard the setting."""
    generator, cond, uncond = tiny

    def detach_cond(x, sigma, cond, uncond):
        v_c, v_u = _branches(generator, x, sigma, cond, uncond)
        return v_u + G * (v_c.detach() - v_u)

    def detach_only_the_base(x, sigma, cond, uncond):
        v_c, v_u = _branches(generator, x, sigma, cond, uncond)
        return v_u.detach() + G * (v_c - v_u)  # the difference still carries -g dv_u

    for wrong in (detach_cond, detach_only_the_base):
        with torch.no_grad():
            x = random_latents(generator.latent_shape, 3, seed=5)
            right = _loop(generator, detach_uncond=True).velocity(x, 0.5, cond, uncond)
            assert torch.equal(wrong(x, 0.5, cond, uncond), right), "the same forward values"
        with pytest.raises(AssertionError):
            _check_cfg_gradients(wrong, generator, cond, uncond, detach=True)


# ------------------------------------------------------------------ guidance_scale_2 (Wan2.2)
@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    folder = make_wan22_pipeline(tmp_path_factory.mktemp("wan22"))
    generator = load_generator(
        folder, dtype="float32", lora_rank=4, lora_alpha=8.0, max_sequence_length=16, height=16, width=16, num_frames=5
    )
    generator.build()
    cond = generator.encode(["a red cat", "b", "dog", "blue"])
    return generator, cond, generator.encode([""])


def test_guidance_scale_2_guides_the_low_noise_rows_in_a_mixed_batch(wan22) -> None:
    generator, cond, uncond = wan22
    config = RolloutConfig(num_steps=4, guidance_scale=3.0, guidance_scale_2=4.0)
    loop = DiffusionDenoise(generator, config)
    x = random_latents(generator.latent_shape, 4, seed=3)
    sigma = torch.tensor([0.3, 0.95, 0.5, 0.9])
    assert generator.expert_index(sigma).tolist() == [LOW_NOISE, HIGH_NOISE, LOW_NOISE, HIGH_NOISE]
    with torch.no_grad():
        got = loop.velocity(x, sigma, cond, uncond)
        # The per-expert formula on the same batched forward: g = 4 on transformer_2's rows, 3 on transformer's.
        v_c, v_u = _branches(generator, x, sigma, cond, uncond)
        for i, g in enumerate([4.0, 3.0, 4.0, 3.0]):
            assert torch.equal(got[i], v_u[i] + g * (v_c[i] - v_u[i])), i
        # And with each expert run alone on its rows, conditional and unconditional.
        for row, expert, g in ((0, generator.model_2, 4.0), (1, generator.model, 3.0)):
            xs, s = x[row : row + 1], sigma[row : row + 1]
            c = generator.velocity_of(expert, xs, s, {k: v[row : row + 1] for k, v in cond.items()})
            u = generator.velocity_of(expert, xs, s, uncond)
            torch.testing.assert_close(got[row : row + 1], u + g * (c - u), rtol=1e-5, atol=1e-5)
        # The high-noise rows are exactly those of guidance 3 everywhere; the low-noise rows are not.
        one = DiffusionDenoise(generator, RolloutConfig(num_steps=4, guidance_scale=3.0))
        same = one.velocity(x, sigma, cond, uncond)
        assert torch.equal(got[[1, 3]], same[[1, 3]]) and not torch.allclose(got[[0, 2]], same[[0, 2]])
        # A batch on one side takes that side's scale whole; None is guidance_scale everywhere.
        low_only = loop.velocity(x, 0.3, cond, uncond)
        four = DiffusionDenoise(generator, RolloutConfig(num_steps=4, guidance_scale=4.0))
        assert torch.equal(low_only, four.velocity(x, 0.3, cond, uncond))
        unset = DiffusionDenoise(generator, RolloutConfig(num_steps=4, guidance_scale=3.0))
        assert unset.config.guidance_scale_2 is None and torch.equal(unset.velocity(x, sigma, cond, uncond), same)


def test_guidance_scale_2_rollout_is_recomputed_bitwise_across_the_boundary(wan22) -> None:
    generator, cond, uncond = wan22
    # The tiny folder's own schedule (FlowMatchEuler, shift 3): sigmas 1, .857, .6, .003, 0; the window [0, 2)
    # is one step of each expert.
    config = RolloutConfig(num_steps=4, guidance_scale=3.0, guidance_scale_2=4.0)
    loop = DiffusionDenoise(generator, config, FlowGRPO(sde_window=(0, 2)))
    _, record = loop.sample(cond, [0, 1, 2, 3], [0, 0, 0, 0], "rollout", seed=0, uncond=uncond)
    assert generator.expert_index(record.sigma).tolist() == [HIGH_NOISE, LOW_NOISE]
    assert torch.equal(loop.score(record), record.old_logp)
    # Per-sample windows (Flow-GRPO-Fast): one recorded step whose sigma routes some rows to each expert.
    fast = DiffusionDenoise(generator, config, FlowGRPOFast(window_size=1, window_range=(0, 3)))
    ids = list(range(4))
    _, record = fast.sample(
        {k: v.repeat(2, 1, 1) for k, v in cond.items()}, ids * 2, [0] * 4 + [1] * 4, "rollout", seed=0, uncond=uncond
    )
    assert set(generator.expert_index(record.sigma[:, 0]).tolist()) == {HIGH_NOISE, LOW_NOISE}
    # The re-score runs each expert's rows in batches of another make-up than the rollout's mixed step: one
    # float32 ulp of kernel noise (1.2e-7 measured on torch 2.13 CPU); a wrong scale on either side moves it by
    # orders of magnitude more.
    torch.testing.assert_close(fast.score(record), record.old_logp, rtol=0, atol=1e-6)


def test_guidance_scale_2_is_refused_without_a_low_noise_expert(tiny, tmp_path: Path) -> None:
    generator, cond, uncond = tiny
    x = random_latents(generator.latent_shape, 3)
    config = RolloutConfig(num_steps=4, guidance_scale=G, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match=r"model\.rollout\.guidance_scale_2=3\.0 .* ComponentGenerator has one expert"):
        DiffusionDenoise(generator, config).velocity(x, 0.5, cond, uncond)
    wan21 = load_generator(make_wan_pipeline(tmp_path / "wan21"), height=16, width=16, num_frames=5)
    assert wan21.num_experts == 1
    with pytest.raises(ValueError, match=r"guidance_scale_2.*WanGenerator has one expert"):
        DiffusionDenoise(wan21, config).velocity(random_latents(wan21.latent_shape, 1), 0.5, {}, None)
    negative = RolloutConfig(num_steps=4, guidance_scale=G, guidance_scale_2=-1.0)
    with pytest.raises(ValueError, match=r"guidance_scale_2 must be >= 0"):
        DiffusionDenoise(generator, negative).velocity(x, 0.5, cond, uncond)


# ------------------------------------------------------------------ rollout.shift on a family pipeline
WAN_UNIPC = {
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "solver_order": 2,
    "use_flow_sigmas": True,
}


def _sigmas(scheduler, num_steps: int, **kwargs) -> torch.Tensor:
    if "sigmas" in kwargs:
        scheduler.set_timesteps(**kwargs)  # custom sigmas replace the step count, as retrieve_timesteps passes them
    else:
        scheduler.set_timesteps(num_steps, **kwargs)
    sigmas = scheduler.sigmas.to(torch.float64).clone()
    assert 1.0 - float(sigmas[0]) <= 1e-5
    sigmas[0] = 1.0  # UniPC's first flow sigma is 1 - 1e-6 in float32; the sampler starts at 1
    return sigmas


def test_shift_override_recomputes_wan22_unipc_flow_sigmas(tmp_path: Path) -> None:
    """Wan2.2's shift 12 at 4 steps: UniPC's own flow sigmas (0.8006 at step 3), not SD3's formula (0.8)."""
    folder = with_scheduler(make_wan22_pipeline(tmp_path / "wan22"), WAN_UNIPC)
    generator = load_generator(folder, height=16, width=16, num_frames=5)
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=4, shift=12.0), FlowGRPO(sde_window=(2, 4)))
    reference = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=12.0, prediction_type="flow_prediction")
    want = _sigmas(reference, 4)
    torch.testing.assert_close(loop.sigmas(4), want, rtol=0, atol=1e-6)
    assert abs(float(loop.sigmas(4)[3]) - 0.8006) < 1e-4 and abs(float(flow_sigmas(4, 12.0)[3]) - 0.8) < 1e-12
    # The window [2, 4) is one step of each expert (sigmas .923 and .8006).
    assert generator.expert_index(loop.sigmas(4)[2:4]).tolist() == [HIGH_NOISE, LOW_NOISE]
    described = loop.describe()
    assert described["source"].startswith("UniPCMultistepScheduler(flow_shift=12.0")
    assert (
        "model.rollout.shift=12.0, overriding the pipeline's UniPCMultistepScheduler(flow_shift=3.0"
        in described["source"]
    )
    assert described["details"]["flow_shift"] == 12.0 and described["details"]["rollout_shift"] == 12.0
    # Without the override the folder's own flow_shift 3.0 stands.
    own = DiffusionDenoise(generator, RolloutConfig(num_steps=4))
    torch.testing.assert_close(
        own.sigmas(4), _sigmas(UniPCMultistepScheduler.from_config(WAN_UNIPC), 4), rtol=0, atol=1e-6
    )


def test_shift_override_recomputes_flow_match_euler_and_turns_dynamic_shifting_off(tmp_path: Path) -> None:
    sd3 = load_generator(make_sd3_pipeline(tmp_path / "sd3"), height=32, width=32)  # the folder ships shift 3.0
    loop = DiffusionDenoise(sd3, RolloutConfig(num_steps=4, shift=1.0))
    torch.testing.assert_close(
        loop.sigmas(4), _sigmas(FlowMatchEulerDiscreteScheduler(shift=1.0), 4), rtol=0, atol=1e-7
    )
    assert not torch.allclose(loop.sigmas(4), flow_sigmas(4, 1.0)), "the pipeline's scheduler, not linspace"
    # FLUX.1-dev shifts by mu; an explicit shift replaces that (dynamic shifting off), on FluxPipeline's sigmas.
    flux = load_generator(
        with_scheduler(make_flux_pipeline(tmp_path / "flux"), FLUX_DEV_SCHEDULER), height=32, width=32
    )
    loop = DiffusionDenoise(flux, RolloutConfig(num_steps=4, shift=2.0))
    reference = FlowMatchEulerDiscreteScheduler.from_config(
        {**FLUX_DEV_SCHEDULER, "shift": 2.0, "use_dynamic_shifting": False}
    )
    custom = torch.linspace(1.0, 0.25, 4, dtype=torch.float64).tolist()
    torch.testing.assert_close(loop.sigmas(4), _sigmas(reference, 4, sigmas=custom), rtol=0, atol=1e-7)
    assert "use_dynamic_shifting=False" in loop.describe()["source"]
    with pytest.raises(ValueError, match=r"model\.rollout\.shift=2\.0: .*'DDIMScheduler' has no shift"):
        shifted_config({"_class_name": "DDIMScheduler"}, 2.0)


def test_the_projects_own_generator_keeps_the_sd3_shift_formula(tiny) -> None:
    generator, _, _ = tiny
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=4, shift=3.0))
    assert torch.equal(loop.sigmas(4), flow_sigmas(4, 3.0))
    assert loop.describe()["source"] == "model.rollout.shift=3.0"


# ------------------------------------------------------------------ the recipes
def _rollout(name: str) -> dict:
    return yaml.safe_load((ROOT / "recipes" / name).read_text())["model"]["init_args"]["rollout"]


def test_recipes_set_detach_uncond_and_wan22s_low_noise_guidance() -> None:
    for name in ("sd35.yaml", "sd35_ocr.yaml", "sd35_pickscore.yaml"):
        assert _rollout(name)["detach_uncond"] is True, name
    for name in ("wan_t2v.yaml", "wan22_t2v.yaml"):
        assert _rollout(name)["detach_uncond"] is False, name
    # Wan2.2 T2V-A14B: sample_guide_scale = (3.0, 4.0), low noise first: 4.0 on transformer, 3.0 on transformer_2.
    wan22 = _rollout("wan22_t2v.yaml")
    assert (wan22["guidance_scale"], wan22["guidance_scale_2"]) == (4.0, 3.0)
    assert "guidance_scale_2" not in _rollout("wan_t2v.yaml"), "Wan2.1 has one expert"
