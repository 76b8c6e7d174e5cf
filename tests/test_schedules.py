"""The family generators sample on the schedule their own diffusers pipeline uses.

Each tiny pipeline folder gets the scheduler config the public checkpoint ships (SD3.5-Medium,
FLUX.1-dev, FLUX.1-schnell, Wan2.1-T2V); the reference is not a formula of ours but the sigmas the
diffusers pipeline itself leaves on its scheduler after a real ``pipe(...)`` call, at two sample sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from tests.pipelines import FLUX_DEV_SCHEDULER, make_flux_pipeline, make_sd3_pipeline, make_wan_pipeline, with_scheduler
from unirl_pl.algorithms import FlowGRPO
from unirl_pl.generators import load_generator
from unirl_pl.generators.schedule import FIRST_SIGMA_SNAP, scheduler_sigmas
from unirl_pl.loops import DiffusionDenoise, RolloutConfig, write_schedule
from unirl_pl.sampling import flow_sigmas

# The scheduler configs of the public checkpoints (their scheduler/scheduler_config.json, trimmed to the
# keys that shape the schedule; everything else is the class default).
SD35_MEDIUM = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX_DEV = FLUX_DEV_SCHEDULER
FLUX_SCHNELL = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}
WAN21_T2V = {
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "solver_order": 2,
    "use_flow_sigmas": True,
}

# (builder, scheduler config, two sample sizes (height, width, frames), pipeline call kwargs per size)
CASES = {
    "sd35": (make_sd3_pipeline, SD35_MEDIUM, [(32, 32, 1), (64, 32, 1)]),
    "flux_dev": (make_flux_pipeline, FLUX_DEV, [(32, 32, 1), (64, 96, 1)]),
    "flux_schnell": (make_flux_pipeline, FLUX_SCHNELL, [(32, 32, 1), (64, 96, 1)]),
    "wan21": (make_wan_pipeline, WAN21_T2V, [(16, 16, 5), (32, 16, 5)]),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    make, config, sizes = CASES[request.param]
    folder = with_scheduler(make(tmp_path_factory.mktemp(request.param)), config)
    return request.param, folder, sizes


def _pipeline_sigmas(folder: Path, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
    """The sigmas the diffusers pipeline itself samples with: run it and read its scheduler afterwards.
    UniPC's first sigma is 1 - 1e-6 in float32; the sampler starts at exactly 1 (both start from pure
    noise), checked here to be the only difference."""
    pipe = DiffusionPipeline.from_pretrained(str(folder))
    kwargs = {"num_frames": frames} if frames > 1 else {}
    pipe("a red circle", num_inference_steps=num_steps, height=height, width=width, output_type="latent", **kwargs)
    sigmas = pipe.scheduler.sigmas.to(torch.float64).clone()
    assert 1.0 - float(sigmas[0]) <= FIRST_SIGMA_SNAP
    sigmas[0] = 1.0
    return sigmas


@pytest.mark.parametrize("num_steps", [4, 7])
def test_generator_schedule_is_the_pipelines_own_at_two_sizes(case, num_steps):
    name, folder, sizes = case
    schedules = []
    for height, width, frames in sizes:
        video = {"num_frames": frames} if name.startswith("wan") else {}
        generator = load_generator(folder, height=height, width=width, **video)
        ours = generator.schedule(num_steps).sigmas
        expected = _pipeline_sigmas(folder, num_steps, height, width, frames)
        assert ours.shape == (num_steps + 1,) and ours[0] == 1.0 and ours[-1] == 0.0
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)
        # The loop samples on exactly this schedule when the recipe sets no shift.
        loop = DiffusionDenoise(generator, RolloutConfig(num_steps=num_steps))
        torch.testing.assert_close(loop.sigmas(num_steps), expected, rtol=0, atol=1e-7)
        schedules.append(ours)
    linear = flow_sigmas(num_steps)
    if name == "flux_dev":
        # Dynamic shifting: mu grows with the image's token count, so the two sizes differ.
        assert not torch.allclose(schedules[0], schedules[1])
        assert (schedules[1][1:-1] > schedules[0][1:-1]).all(), "a larger image is shifted towards noise"
    else:
        torch.testing.assert_close(schedules[0], schedules[1], rtol=0, atol=0)
    if name == "flux_schnell":
        torch.testing.assert_close(schedules[0][:-1], linear[:-1], rtol=0, atol=1e-7)
    else:
        assert (schedules[0] - linear).abs().max() > 0.05, "the pipeline's schedule is not linspace(1, 0)"


def test_sd35_ten_steps_are_the_published_schedule(tmp_path):
    """The 10-step SD3.5-Medium sigmas as diffusers 0.42 samples them (the numbers the issue quotes)."""
    folder = with_scheduler(make_sd3_pipeline(tmp_path / "sd35"), SD35_MEDIUM)
    sigmas = load_generator(folder, height=32, width=32).schedule(10).sigmas
    published = [1.0, 0.96, 0.913, 0.858, 0.79, 0.707, 0.602, 0.465, 0.278, 0.009, 0.0]
    torch.testing.assert_close(sigmas, torch.tensor(published, dtype=torch.float64), rtol=0, atol=6e-4)


def test_a_recipe_shift_overrides_the_pipeline_and_says_so(tmp_path):
    folder = with_scheduler(make_sd3_pipeline(tmp_path / "sd35"), SD35_MEDIUM)
    generator = load_generator(folder, height=32, width=32)
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=4, shift=1.0), FlowGRPO(sde_window=(0, 2)))
    # The override rebuilds the pipeline's own scheduler with shift 1.0 and calls set_timesteps as
    # StableDiffusion3Pipeline does (no mu: SD3.5 does not shift dynamically): 1, .667, .334, .001, 0.
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler", shift=1.0)
    scheduler.set_timesteps(4, device="cpu")
    expected = scheduler.sigmas.to(torch.float64)
    assert float(expected[0]) == 1.0 and float(expected[-1]) == 0.0
    # Not the SD3 formula on linspace(1, 0) (linear at shift 1.0), which the override used to apply.
    assert (expected - flow_sigmas(4, 1.0)).abs().max() > 0.2
    torch.testing.assert_close(loop.sigmas(4), expected, rtol=0, atol=0)
    described = write_schedule(loop, tmp_path / "run")
    assert described["source"].startswith("FlowMatchEulerDiscreteScheduler(shift=1.0")
    assert "model.rollout.shift=1.0" in described["source"] and "overriding" in described["source"]
    assert "FlowMatchEulerDiscreteScheduler(shift=3.0" in described["source"]
    on_disk = json.loads((tmp_path / "run" / "schedule.json").read_text())
    assert on_disk["sigmas"] == expected.tolist() and on_disk["sde_steps"] == [0, 1]


def test_schedule_json_describes_the_pipeline_schedule_and_sde_steps(tmp_path):
    folder = with_scheduler(make_flux_pipeline(tmp_path / "flux"), FLUX_DEV)
    generator = load_generator(folder, height=32, width=32)
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=6), FlowGRPO(sde_window=(1, 4)))
    on_disk = write_schedule(loop, tmp_path / "run")
    assert on_disk == json.loads((tmp_path / "run" / "schedule.json").read_text())
    assert on_disk["sigmas"] == generator.schedule(6).sigmas.tolist()
    assert on_disk["sde_steps"] == [1, 2, 3]
    assert on_disk["source"].startswith("FlowMatchEulerDiscreteScheduler(") and "mu=" in on_disk["source"]
    # Other ranks describe the schedule but write nothing.
    assert write_schedule(loop, tmp_path / "rank1", write=False) == on_disk
    assert not (tmp_path / "rank1").exists()


def test_a_scheduler_that_does_not_give_a_flow_schedule_is_refused():
    with pytest.raises(ValueError, match="decreasing schedule from 1 to 0"):
        scheduler_sigmas(FlowMatchEulerDiscreteScheduler(invert_sigmas=True), 4)
