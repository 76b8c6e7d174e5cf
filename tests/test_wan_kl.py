"""Flow-GRPO's Wan KL, written out from its trainer, against the ``kl_form`` the Wan recipes set.

Flow-GRPO's Wan trainer (github.com/yifan123/flow_grpo at 9745241, scripts/train_wan2_1.py) recomputes a step with
``sde_step_with_logprob(..., return_dt_and_std_dev_t=True)`` (lines 221-228), which returns ``std_dev_t`` and, as
its ``dt``, ``torch.sqrt(-1*dt)`` (flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py:82-83), and divides the
squared mean difference by ``2 * (std_dev_t * dt_ref) ** 2`` (train_wan2_1.py:959): the step's full variance, the
form ``kl_form: promptrl`` computes; its SD3 trainer divides by ``2 * std_dev_t ** 2`` (scripts/train_sd3.py:900),
``-dt`` times less. Below, the reference's lines are written out as they stand (its step on the pipeline folder's
own ``UniPCMultistepScheduler``, 5-D video latents, float32), at each trained step of each recipe's SDE window and
on its schedule: the Wan2.1 folder's ``flow_shift`` 3.0 for wan_t2v, ``flow_shift`` replaced by the recipe's
``shift`` 12 for wan22_t2v. The package's KL in the recipe's form must give the reference's number and the other
form must not. The inputs are the reference step's own means and ``std_dev_t``: this checks the KL's form, not the
step (the package's Gaussian step takes Flow-GRPO's SD3 noise scale, not the Wan step's, docs/reproduce.md).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import yaml
from diffusers import UniPCMultistepScheduler

from tests.helpers import ROOT
from unirl_pl.algorithms.drivers import step_kl
from unirl_pl.method import ExpertLoss
from unirl_pl.sampling import flow_kl, promptrl_kl

CONFIGS = ROOT / "unirl_pl" / "assets" / "configs"
# recipe -> the diffusers folder whose scheduler it samples on (the recipe's `shift`, where set, replaces its own)
RECIPES = {"wan_t2v": "Wan2.1-T2V-1.3B-Diffusers", "wan22_t2v": "Wan2.2-T2V-A14B-Diffusers"}
VERIFIED_FORM = "promptrl"


def recipe(name: str) -> dict:
    return yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())["model"]["init_args"]


def recipe_scheduler(name: str) -> UniPCMultistepScheduler:
    """The folder's own scheduler as ``WanPipeline.from_pretrained`` builds it, at the recipe's steps and shift."""
    config = json.loads((CONFIGS / RECIPES[name] / "scheduler" / "scheduler_config.json").read_text())
    rollout = recipe(name)["rollout"]
    if rollout.get("shift") is not None:
        config["flow_shift"] = float(rollout["shift"])
    scheduler = UniPCMultistepScheduler.from_config(config)
    scheduler.set_timesteps(rollout["num_steps"])  # wan_pipeline_with_logprob.py:229
    return scheduler


def sde_step_with_logprob(self, model_output, timestep, sample):
    """wan_pipeline_with_logprob.py:35-52 and 82-83 @9745241, as the trainer calls it (``prev_sample`` given,
    ``return_dt_and_std_dev_t=True``): ``(prev_sample_mean, std_dev_t, torch.sqrt(-1*dt))``."""
    model_output = model_output.float()
    sample = sample.float()

    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]

    self.sigmas = self.sigmas.to(sample.device)
    sigma = self.sigmas[step_index].view(-1, 1, 1, 1, 1)
    sigma_prev = self.sigmas[prev_step_index].view(-1, 1, 1, 1, 1)
    sigma_max = self.sigmas[1].item()
    sigma_min = self.sigmas[-1].item()
    dt = sigma_prev - sigma

    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    prev_sample_mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)


def reference_kl(scheduler, j: int, latents, v, v_ref):
    """train_wan2_1.py:937-960 @9745241 at training step ``j``: the trainer's ``kl_loss`` before and after its
    ``torch.mean``, with the step's ``prev_sample_mean`` pair, ``std_dev_t`` and sigmas."""
    timesteps = scheduler.timesteps.repeat(latents.shape[0], 1)  # train_wan2_1.py:703
    t = timesteps[:, j]
    prev_sample_mean, std_dev_t, dt = sde_step_with_logprob(scheduler, v, t, latents)
    prev_sample_mean_ref, std_dev_t_ref, dt_ref = sde_step_with_logprob(scheduler, v_ref, t, latents)
    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
        2 * (std_dev_t * dt_ref) ** 2
    )
    assert [scheduler.index_for_timestep(x) for x in t] == [j] * len(t)
    sigma = scheduler.sigmas[j].repeat(len(t))
    sigma_next = scheduler.sigmas[j + 1].repeat(len(t))
    return kl_loss, torch.mean(kl_loss), (prev_sample_mean, prev_sample_mean_ref, std_dev_t, sigma, sigma_next)


def ours(form: str, mean, ref_mean, std, sigma, sigma_next) -> torch.Tensor:
    """The package's per-sample KL in ``form``, through the loss drivers' dispatch on ``kl_form``."""
    record = SimpleNamespace(kind="sde", step_sigmas=lambda step, chunk: (sigma, sigma_next, sigma[0]))
    loop = SimpleNamespace(step_logprob=lambda record, step, chunk: (None, ref_mean, std))

    @contextmanager
    def reference():
        yield

    kl = step_kl(loop, record, 0, (0, mean.shape[0]), mean, std, 0.004, reference, form)  # type: ignore[arg-type]
    assert kl is not None
    direct = promptrl_kl(mean, ref_mean, std, sigma, sigma_next) if form == "promptrl" else flow_kl(mean, ref_mean, std)
    assert torch.equal(kl, direct)
    return kl


def _latents(seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 16, 3, 4, 6)  # (B, C, F, H, W): Wan's video latents
    latents = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    v_ref = v + 0.2 * torch.randn(shape, generator=g)
    return latents, v, v_ref


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_recipes_kl_form_gives_flow_grpos_wan_kl_on_every_trained_step(name):
    loss = recipe(name)["transformer_loss"]
    form = ExpertLoss(**loss).kl_form
    assert form == VERIFIED_FORM
    scheduler = recipe_scheduler(name)
    start, stop = recipe(name)["generator_algorithm"]["init_args"]["sde_window"]
    for j in range(start, stop):
        latents, v, v_ref = _latents(seed=j)
        per_element, want, (mean, ref_mean, std, sigma, sigma_next) = reference_kl(scheduler, j, latents, v, v_ref)
        got = ours(form, mean, ref_mean, std, sigma, sigma_next)
        # per sample (the reference's keepdim mean leaves W; its torch.mean then averages it and the batch)
        torch.testing.assert_close(got, per_element.mean(dim=(1, 2, 3, 4)), rtol=1e-6, atol=0)
        torch.testing.assert_close(got.mean(), want, rtol=1e-6, atol=0)
        # The other form is -dt (or 1 / -dt) times it: a flipped kl_form fails here.
        for other in {"flow_grpo", "promptrl"} - {form}:
            wrong = ours(other, mean, ref_mean, std, sigma, sigma_next).mean()
            assert abs(float(wrong / want) - 1) > 0.5, (name, j, other)


def test_flow_grpos_wan_kl_is_its_sd3_form_divided_by_minus_dt():
    """The SD3 trainer's ``/ (2 * std_dev_t ** 2)`` (scripts/train_sd3.py:900 @9745241) on the same means is the
    Wan KL times ``-dt``: 47-58x smaller at wan_t2v's trained steps 0-3 (shift 3, 20 steps)."""
    scheduler = recipe_scheduler("wan_t2v")
    for j in range(4):
        latents, v, v_ref = _latents(seed=10 + j)
        _, want, (mean, ref_mean, std, sigma, sigma_next) = reference_kl(scheduler, j, latents, v, v_ref)
        sd3 = torch.mean(((mean - ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2))
        minus_dt = float(sigma[0] - sigma_next[0])
        torch.testing.assert_close(sd3 / want, torch.tensor(minus_dt), rtol=1e-5, atol=0)
        assert 45 < 1 / minus_dt < 60


def test_both_wan_recipes_set_the_verified_kl_form():
    for name in RECIPES:
        assert recipe(name)["transformer_loss"]["kl_form"] == VERIFIED_FORM, name
