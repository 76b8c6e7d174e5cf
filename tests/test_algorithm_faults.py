"""Reference checks for four algorithm faults that the fast tiers of test_algorithms, test_schedules,
test_sampling and test_losses let through (issue 31, item 4). Each test computes our numbers and the
reference's on the same inputs: the published formula written out in float64, or diffusers itself.

1. GRPO-Guard's noise scale ``std * sqrt(-dt)`` (fault: ``std * (-dt)``), through ``FlowGRPO(guard=True).loss``
   on a hand-built record with a stub loop.
2. MixGRPO-Flash's DPM-Solver++(2M) after the SDE window, against diffusers' ``DPMSolverMultistepScheduler``
   with the history handed over from the window's last prediction (fault: the history's sigma read one step
   late, which silently makes every step first order).
3. DiffusionNFT's forward process ``xt = (1 - t) x0 + t eps`` (fault: ``t`` and ``1 - t`` swapped) and its
   per-sample adaptive weight (fault: averaged over the batch).
4. SD3's (and FLUX's) dynamic shift on a non-square image: ``image_seq_len`` from H x W (fault: H x H).

All run in well under a second each: stub loops and generators, no pipeline weights.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from unirl_pl.algorithms import DiffusionNFT, FlowGRPO
from unirl_pl.algorithms.drivers import LossInputs
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.loops.config import SampleRequest, StepPlan
from unirl_pl.losses import nft_loss
from unirl_pl.method import ExpertLoss
from unirl_pl.records import DiTRecord
from unirl_pl.sampling import compress_tail, flow_sigmas

# ------------------------------------------------------------------ 1. GRPO-Guard's noise scale


class _GuardLoop:
    """The ``train`` profile of a diffusion loop reduced to what GRPO-Guard reads: ``step_logprob(record, step,
    chunk) -> (logp, mean, std)`` from fixed per-(sample, step) tables; ``drift`` moves every step mean by
    ``offset`` (the policy after an update)."""

    def __init__(self, logp: torch.Tensor, mean: torch.Tensor, offset: torch.Tensor, std: torch.Tensor) -> None:
        self.logp, self.mean, self.offset, self.std = logp, mean, offset, std
        self.drift = 0.0

    def step_logprob(self, record, step, chunk):
        a, b = chunk
        mean = self.mean[a:b, step] + self.drift * self.offset[a:b, step]
        return self.logp[a:b, step], mean, self.std[a:b, step].reshape(-1, 1, 1, 1)


def _guard_reference(logp, old_logp, adv, mean, old_mean, std, dt, clip_eps, noise_scale):
    """GRPO-Guard's per-step loss in float64 (arXiv 2510.22319, as verl-omni implements it:
    verl_omni/trainer/diffusion/diffusion_algos.py, GRPOGuardLoss.compute_loss, lines 529-549 at commit
    a1139bafffb5b9711f0a6b6edff8ecaa60bfff30): ``scale = std * sqrt(-dt)``, the mean-drift bias
    ``b = mean((mean - old_mean)^2) / (2 scale^2)``, the ratio ``exp((logp - old + b) * scale)``, PPO's clip,
    and each step's surrogate divided by ``sqrt(-dt)^2 = -dt``; the loss is the mean over (sample, step).
    ``noise_scale`` maps ``(std, dt)`` to the scale, so the fault can be written out too."""
    scale = noise_scale(std, dt)  # (N, S)
    bias = ((mean - old_mean) ** 2).mean(dim=(2, 3, 4)) / (2 * scale**2)
    ratio = torch.exp((logp - old_logp + bias) * scale)
    a = adv[:, None]
    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_eps, 1 + clip_eps)) / (-dt)
    return surrogate.mean(), ratio


def test_grpo_guard_loss_matches_the_reference_noise_scale_and_reweighting():
    """``FlowGRPO(guard=True).loss`` on a record of 4 samples x 3 SDE steps (two micro-batches), old means
    from ``before_updates``, then drifted means: the loss and the ratios equal the float64 reference, whose
    noise scale is ``std * sqrt(-dt)``; the same reference with ``std * (-dt)`` is far off on these numbers."""
    g = torch.Generator().manual_seed(0)
    n, steps, shape = 4, 3, (2, 3, 3)
    sigmas = flow_sigmas(6, shift=3.0)  # steps 0-2 of a shifted schedule: three different dt
    std = (0.7 * torch.sqrt(sigmas[1:4] / (1 - sigmas[1:4])))[None].expand(n, steps).contiguous()
    std = std * torch.linspace(0.9, 1.1, n, dtype=torch.float64)[:, None]  # per sample, to see rows mix up
    logp = -1.0 + 0.6 * torch.randn(n, steps, generator=g, dtype=torch.float64)
    old_logp = -1.0 + 0.6 * torch.randn(n, steps, generator=g, dtype=torch.float64)
    mean = torch.randn(n, steps, *shape, generator=g, dtype=torch.float64)
    offset = 0.3 * torch.randn(n, steps, *shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5, 0.8, -1.2], dtype=torch.float64)
    loop = _GuardLoop(logp.float(), mean.float(), offset.float(), std.float())
    record = DiTRecord(
        prev=torch.zeros(n, steps, *shape),
        sample=torch.zeros(n, steps, *shape),
        sigma=sigmas[:steps].clone(),
        sigma_next=sigmas[1 : steps + 1].clone(),
        old_logp=old_logp.float(),
        cond={},
        sigma_max=float(sigmas[1]),
        noise_level=0.7,
        chunks=[(0, 2), (2, 4)],
        version=0,
    )
    algorithm = FlowGRPO(sde_window=(0, steps), guard=True)
    algorithm.before_updates(loop, record)  # the old step means, before any update
    loop.drift = 1.0
    clip_eps = 0.15
    settings = ExpertLoss(clip_eps=clip_eps, beta=0.0)
    out = algorithm.loss(LossInputs(loop, record, adv.float(), settings, nullcontext))

    dt = (sigmas[1 : steps + 1] - sigmas[:steps])[None]  # (1, S), negative
    new_mean = mean + offset
    want, ratio = _guard_reference(
        logp, old_logp, adv, new_mean, mean, std, dt, clip_eps, lambda s, d: s * torch.sqrt(-d)
    )
    assert 0.0 < float(((ratio - 1).abs() > clip_eps).double().mean()) < 1.0, "some terms clipped, some not"
    torch.testing.assert_close(out.pg_loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ratio_min.double(), ratio.min(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ratio_max.double(), ratio.max(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ratio_mean.double(), ratio.mean(), rtol=1e-5, atol=1e-6)
    # The check has the power to see the fault: the scale std * (-dt) gives another loss on these numbers.
    wrong, _ = _guard_reference(logp, old_logp, adv, new_mean, mean, std, dt, clip_eps, lambda s, d: s * (-d))
    assert abs(float(wrong - want)) > 100 * (1e-6 + 1e-5 * abs(float(want)))


# ------------------------------------------------------------------ 2. MixGRPO-Flash's DPM-Solver++(2M)


class _Field:
    """A generator reduced to what the loop reads: ``latent_shape`` and a fixed nonlinear velocity field."""

    latent_shape = (3, 4, 4)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
        weight = torch.linspace(-0.4, 0.4, 9).reshape(3, 3)
        s = sigma.reshape(-1, 1, 1, 1)
        return torch.tanh(torch.einsum("ij,bjhw->bihw", weight, x)) + 0.5 * s * cond["c"].reshape(-1, 1, 1, 1)


def _diffusers_tail(field, cond, sigmas, x_last, x_after, order):
    """diffusers' ``DPMSolverMultistepScheduler`` (dpmsolver++, midpoint, flow prediction) on the schedule
    ``sigmas`` from the window's last step on: its first step only registers the window's last prediction
    (at ``x_last``) in the solver's history; the rest runs from ``x_after``, the window's stochastic result.
    ``order`` 1 is the first-order (Euler) solver, for contrast."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        solver_order=order,
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
        final_sigmas_type="zero",
    )
    steps = sigmas.numel() - 1
    scheduler.set_timesteps(steps)
    assert scheduler.sigmas.numel() == steps + 1 and len(scheduler.timesteps) == steps
    scheduler.sigmas = sigmas.to(torch.float32)  # the same sigmas as the loop (its thinned tail)
    scheduler.set_begin_index(0)
    n = x_last.shape[0]

    def velocity(x, k):
        return field.velocity(x, torch.full((n,), float(sigmas[k]), dtype=torch.float32), cond)

    scheduler.step(velocity(x_last, 0), scheduler.timesteps[0], x_last)  # history: the window's last x0
    x = x_after
    for k in range(1, steps):
        x = scheduler.step(velocity(x, k), scheduler.timesteps[k], x).prev_sample
    return x


def test_mix_grpo_flash_post_window_trajectory_is_diffusers_dpm_solver_2m():
    """The loop's MixGRPO-Flash rollout (SDE on steps 2-3 of 10, then DPM-Solver++(2M) on the tail thinned to
    0.8): its final latents equal diffusers' multistep solver run on the same sigmas and velocities from the
    window's result, with the window's last prediction as the solver's history. A solver that drops to first
    order (a history sigma one step late, or no hand-over) ends far from it."""
    field = _Field()
    loop = DiffusionDenoise(field, RolloutConfig(num_steps=10, shift=3.0))
    cond = {"c": torch.tensor([1.0, -0.5])}
    request = SampleRequest(cond, [0, 1], [0, 0], seed=3)
    start, size, keep = 2, 2, 0.8
    latents, record = loop.run(request, StepPlan((start, start), size, post_solver="dpm2", post_keep=keep))
    post_from = start + size
    tail = compress_tail(loop.sigmas(10), post_from, keep)
    assert tail.numel() - 1 - post_from >= 3, "several second-order steps after the window"
    x_last, x_after = record.prev[:, -1], record.sample[:, -1]
    theirs = _diffusers_tail(field, cond, tail[post_from - 1 :], x_last, x_after, order=2)
    torch.testing.assert_close(latents, theirs, atol=2e-5, rtol=0)
    # The second-order correction is what is checked: the first-order solver ends well outside the tolerance.
    euler = _diffusers_tail(field, cond, tail[post_from - 1 :], x_last, x_after, order=1)
    assert (euler - theirs).abs().max() > 1e-3


# ------------------------------------------------------------------ 3. DiffusionNFT


def _nft_reference(v, v_old, xt, x0, t, r, beta, clip_max):
    """DiffusionNFT's policy loss in float64, as NVlabs/DiffusionNFT's scripts/train_nft_sd3.py (lines 934-960
    at commit 24af5554898d85e93efa492f42b5e9cdf4156e9b): implicit positive ``beta v + (1 - beta) v_old`` and
    negative ``(1 + beta) v_old - beta v`` policies, each predicting ``x0 = xt - t v``; each sample's squared
    error divided by its own mean absolute error (``mean`` over the non-batch dims, ``keepdim``, floored at
    1e-5); ``clip_max * mean(r err+ / beta + (1 - r) err- / beta)``."""
    dims = tuple(range(1, x0.ndim))
    tt = t.reshape(-1, *([1] * (x0.ndim - 1)))

    def weighted(pred_v):
        pred = xt - tt * pred_v
        weight = (pred - x0).abs().mean(dim=dims, keepdim=True).clamp_min(1e-5)
        return ((pred - x0) ** 2 / weight).mean(dim=dims)

    pos, neg = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
    return (clip_max * (r * weighted(pos) / beta + (1 - r) * weighted(neg) / beta)).mean()


def test_nft_loss_matches_the_reference_per_sample_on_a_mixed_batch():
    """Three samples at t != 1/2 whose errors differ by orders of magnitude: the loss equals the float64
    reference, whose adaptive weight is each sample's own (a batch-wide weight, or ``x0 = xt - (1 - t) v``,
    gives another number here)."""
    g = torch.Generator().manual_seed(1)
    shape = (3, 2, 4, 4)
    scales = torch.tensor([1.0, 20.0, 0.05], dtype=torch.float64).reshape(-1, 1, 1, 1)
    x0 = torch.randn(shape, generator=g, dtype=torch.float64) * scales
    xt = torch.randn(shape, generator=g, dtype=torch.float64) * scales
    v = torch.randn(shape, generator=g, dtype=torch.float64) * scales
    v_old = v + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64) * scales
    t = torch.tensor([0.2, 0.65, 0.9], dtype=torch.float64)
    r = torch.tensor([0.9, 0.3, 0.6], dtype=torch.float64)
    beta, clip_max = 0.7, 5.0
    out = nft_loss(v.float(), v_old.float(), xt.float(), x0.float(), t.float(), r.float(), nft_beta=beta)
    want = _nft_reference(v, v_old, xt, x0, t, r, beta, clip_max)
    torch.testing.assert_close(out.pg_loss.double(), want, rtol=1e-5, atol=0)
    # A sample alone gives the same per-sample term: the weight does not depend on the rest of the batch.
    for i in range(3):
        alone = nft_loss(
            v[i : i + 1].float(), v_old[i : i + 1].float(), xt[i : i + 1].float(), x0[i : i + 1].float(),
            t[i : i + 1].float(), r[i : i + 1].float(), nft_beta=beta,
        )  # fmt: skip
        ref = _nft_reference(v[i : i + 1], v_old[i : i + 1], xt[i : i + 1], x0[i : i + 1], t[i : i + 1], r[i : i + 1],
                             beta, clip_max)  # fmt: skip
        torch.testing.assert_close(alone.pg_loss.double(), ref, rtol=1e-5, atol=0)


class _PointsLoop:
    """A diffusion loop reduced to what DiffusionNFT's rollout reads: its config, its schedule, an ODE ``run``
    that returns fixed clean samples, and a velocity."""

    def __init__(self, x0: torch.Tensor) -> None:
        self.x0 = x0
        self.config = RolloutConfig(num_steps=4)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, shift=2.0)  # 1, .857, .667, .4, 0: no point at t = 1/2

    def run(self, request, plan):
        return self.x0.clone(), None

    def velocity(self, x, t, cond, uncond):
        return 0.5 * x - t.reshape(-1, 1, 1, 1)


def test_nft_rollout_records_the_reference_forward_process():
    """The recorded points are ``xt = (1 - t) x0 + t eps`` (train_nft_sd3.py line 870 at the commit above):
    two rollouts of the same samples and seed but other clean samples draw the same ``t`` and ``eps``, so
    ``xt_a - xt_b = (1 - t) (x0_a - x0_b)`` exactly and the ``eps`` recovered from either is the same standard
    normal draw; the old velocity is the loop's at each point."""
    g = torch.Generator().manual_seed(2)
    x0_a = torch.randn(2, 4, 8, 8, generator=g)
    x0_b = x0_a + 3.0 + torch.randn(2, 4, 8, 8, generator=g)
    request = SampleRequest({"c": torch.zeros(2)}, [0, 1], [0, 1], seed=5)
    nft = DiffusionNFT()  # not bound: no trainable weights, its old policy is the loop as it is
    _, rec_a = nft.rollout(_PointsLoop(x0_a), request)
    _, rec_b = nft.rollout(_PointsLoop(x0_b), request)
    assert torch.equal(rec_a.t, rec_b.t) and rec_a.t.shape == (2, 3)
    t = rec_a.t.double().reshape(2, 3, 1, 1, 1)
    assert float((t - 0.5).abs().min()) > 0.05, "no point at t = 1/2, where the swap is invisible"
    dx0 = (x0_a - x0_b).double()[:, None]
    torch.testing.assert_close((rec_a.xt - rec_b.xt).double(), (1 - t) * dx0, atol=1e-5, rtol=0)
    eps_a = (rec_a.xt.double() - (1 - t) * x0_a.double()[:, None]) / t
    eps_b = (rec_b.xt.double() - (1 - t) * x0_b.double()[:, None]) / t
    torch.testing.assert_close(eps_a, eps_b, atol=1e-4, rtol=0)
    assert abs(float(eps_a.mean())) < 0.15 and abs(float(eps_a.std()) - 1) < 0.15, "eps ~ N(0, 1)"
    want_v = 0.5 * rec_a.xt - rec_a.t.reshape(2, 3, 1, 1, 1)
    torch.testing.assert_close(rec_a.old_v, want_v, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ 4. dynamic shift on a non-square image


def _pipeline_folder(root: Path, pipeline: str, transformer: str, scheduler: dict, transformer_config: dict) -> Path:
    """A pipeline folder with only the configs the schedule reads (model index, scheduler, transformer, VAE)."""
    root.mkdir()
    index = {
        "_class_name": pipeline,
        "scheduler": ["diffusers", scheduler["_class_name"]],
        "transformer": ["diffusers", transformer],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    for sub, config in (
        ("scheduler", scheduler),
        ("transformer", transformer_config),
        ("vae", {"block_out_channels": [128, 256, 512, 512]}),  # VAE scale factor 8
    ):
        (root / sub).mkdir()
        name = "scheduler_config.json" if sub == "scheduler" else "config.json"
        (root / sub / name).write_text(json.dumps(config))
    return root


DYNAMIC = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.16,
}


def _reference_sigmas(folder: Path, num_steps: int, image_seq_len: int, default_max_shift: float, sigmas=None):
    """What the diffusers pipeline samples with: its scheduler from the folder, ``mu`` from its
    ``calculate_shift`` with the scheduler's config (as ``StableDiffusion3Pipeline.__call__`` and
    ``FluxPipeline.__call__`` compute it, diffusers 0.42), then ``set_timesteps``."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    c = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        c.get("base_image_seq_len", 256),
        c.get("max_image_seq_len", 4096),
        c.get("base_shift", 0.5),
        c.get("max_shift", default_max_shift),
    )
    if sigmas is None:
        scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=mu)
    return scheduler.sigmas.to(torch.float64)


@pytest.mark.parametrize("family", ["sd3", "sd3_unset_max_shift", "flux"])
def test_dynamic_shift_of_a_non_square_image_counts_height_times_width(family, tmp_path):
    """A 512 x 1024 image (and 1024 x 512): ``image_seq_len = (H / 8 / 2) (W / 8 / 2) = 2048`` tokens, so both
    orientations sample on the pipeline's schedule for 2048 tokens, which is neither the 512 x 512 one (1024
    tokens) nor the 1024 x 1024 one (4096). A scheduler config without ``max_shift`` gets the scheduler class's
    default (1.15), which is what ``StableDiffusion3Pipeline`` reads off its scheduler's config."""
    from unirl_pl.generators.flux import FluxGenerator
    from unirl_pl.generators.sd3 import SD3Generator

    if family.startswith("sd3"):
        cls, default_max_shift = SD3Generator, 1.16
        scheduler = DYNAMIC if family == "sd3" else {k: v for k, v in DYNAMIC.items() if k != "max_shift"}
        folder = _pipeline_folder(
            tmp_path / "sd3", "StableDiffusion3Pipeline", "SD3Transformer2DModel", scheduler,
            {"patch_size": 2, "in_channels": 16},
        )  # fmt: skip
    else:
        cls, default_max_shift = FluxGenerator, 1.15
        folder = _pipeline_folder(
            tmp_path / "flux", "FluxPipeline", "FluxTransformer2DModel", {**DYNAMIC, "max_shift": 1.15},
            {"patch_size": 1, "in_channels": 64},
        )  # fmt: skip
    steps = 6
    # FluxPipeline passes its own sigmas linspace(1, 1/N, N); StableDiffusion3Pipeline none.
    custom = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64).tolist() if family == "flux" else None

    def ours(height, width):
        return cls(folder, height=height, width=width).schedule(steps).sigmas

    def theirs(height, width):
        return _reference_sigmas(folder, steps, (height // 16) * (width // 16), default_max_shift, custom)

    wide, tall = ours(512, 1024), ours(1024, 512)
    torch.testing.assert_close(wide, theirs(512, 1024), rtol=0, atol=1e-7)
    torch.testing.assert_close(tall, theirs(1024, 512), rtol=0, atol=1e-7)
    assert (wide - theirs(512, 512)).abs().max() > 1e-3 and (wide - theirs(1024, 1024)).abs().max() > 1e-3
    torch.testing.assert_close(ours(1024, 1024), theirs(1024, 1024), rtol=0, atol=1e-7)
    assert math.isclose(float(wide[0]), 1.0) and float(wide[-1]) == 0.0
