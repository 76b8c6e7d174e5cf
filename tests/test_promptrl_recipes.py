"""The two PromptRL recipes (``recipes/promptrl_klein.yaml``, ``recipes/promptrl_flux.yaml``).

* (integration) Each runs the CPU block its header documents, parsed from the header (the tiny folders built
  by the commands the header names, only the output folders added): two joint steps with C2 green for both
  experts in float32, interleave parity within the recipe's tolerance, both experts fully fine-tuned (no
  adapter, the VLM's vision tower frozen), the refiner's raw replies reaching ``promptrl_format``; and the
  run's ``schedule.json`` is the sigmas diffusers' own pipeline leaves on its scheduler for that size and
  step count.
* At the recipes' real setting (1024 px, 20 steps) the generator's schedule on the shipped configs is
  diffusers' own: its helpers called as the pipeline's ``__call__`` calls them, and (slow) a real pipeline
  call at the same image token count.
* The recipes as written (GPU settings) parse and resolve to PromptRL's values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps as flux_retrieve_timesteps
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from diffusers.pipelines.flux2.pipeline_flux2_klein import retrieve_timesteps as klein_retrieve_timesteps

from tests.helpers import ROOT, assert_joint_steps_green, printed_config, series
from tests.pipelines import make_flux2_klein_pipeline, make_flux_pipeline, with_scheduler
from tests.test_rewards_recipes import cpu_block
from tests.vlm_lm import make_vlm
from unirl_pl.cli import main
from unirl_pl.experts.vlm import vision_tower
from unirl_pl.generators import Flux2KleinGenerator, FluxGenerator
from unirl_pl.plan.models import SHIPPED
from unirl_pl.rewards.builtin import PromptRLFormat

RECIPES = {"klein": ROOT / "recipes" / "promptrl_klein.yaml", "flux": ROOT / "recipes" / "promptrl_flux.yaml"}
# What each header's commands must build (module, builder argument) -> how this test builds it.
BUILDERS = {
    ("tests.pipelines", "flux2_klein"): make_flux2_klein_pipeline,
    ("tests.pipelines", "flux"): make_flux_pipeline,
    ("tests.vlm_lm", "qwen2_5_vl"): lambda folder: make_vlm("qwen2_5_vl", folder),
}
HEADER_BUILDS = {
    "klein": {("tests.pipelines", "flux2_klein"), ("tests.vlm_lm", "qwen2_5_vl")},
    "flux": {("tests.pipelines", "flux"), ("tests.vlm_lm", "qwen2_5_vl")},
}
PIPELINES = {"klein": Flux2KleinPipeline, "flux": FluxPipeline}
GENERATORS = {"klein": Flux2KleinGenerator, "flux": FluxGenerator}
SHIPPED_FOLDERS = {"klein": SHIPPED / "FLUX.2-klein-base-4B", "flux": SHIPPED / "FLUX.1-dev"}


# ------------------------------------------------------------------ the header
def header_builds(recipe: Path) -> list[tuple[str, str, str]]:
    """The ``python -m tests.X NAME FOLDER`` commands of the header's "On CPU" paragraph (it may wrap lines):
    (module, name, folder) each."""
    lines = recipe.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# On CPU"))
    prose = []
    for line in lines[start:]:
        if not line.startswith("#") or line.startswith("#   "):
            break
        prose.append(line[1:].strip())
    return re.findall(r"python -m (tests\.\w+) (\w+) (/\S+?)[;)]", " ".join(prose))


def _recipe_setting(recipe: Path) -> dict[str, Any]:
    """(height, width, num_steps) the recipe as written samples with, from its YAML."""
    model = yaml.safe_load(recipe.read_text())["model"]["init_args"]
    size = model["generator"]["init_args"]
    return {"height": size["height"], "width": size["width"], "num_steps": model["rollout"]["num_steps"]}


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_vlm("qwen2_5_vl", tmp_path_factory.mktemp("qwen25vl"))


def _build_header_folders(name: str, root: Path, vlm_folder: str) -> dict[str, str]:
    """Build the folders the header's commands name (the VLM from the shared fixture); header path -> ours."""
    builds = header_builds(RECIPES[name])
    assert {(module, arg) for module, arg, _ in builds} == HEADER_BUILDS[name], builds
    paths = {}
    for module, arg, folder in builds:
        if module == "tests.vlm_lm":
            paths[folder] = vlm_folder
        else:
            paths[folder] = str(BUILDERS[(module, arg)](root / arg))
    return paths


# ------------------------------------------------------------------ the CPU block end to end
def _pipeline_sigmas(name: str, folder: str, height: int, width: int, num_steps: int) -> torch.Tensor:
    """The sigmas ``FluxPipeline`` / ``Flux2KleinPipeline`` itself leaves on its scheduler after a real call
    for this size and step count (float64)."""
    pipe = PIPELINES[name].from_pretrained(folder)
    extra = {"guidance_scale": 1.0} if name == "klein" else {}
    pipe(
        prompt="a red cat",
        height=height,
        width=width,
        num_inference_steps=num_steps,
        max_sequence_length=16,
        output_type="latent",
        **extra,
    )
    return pipe.scheduler.sigmas.to(torch.float64)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_runs_its_header_cpu_block_with_gates_green(
    name: str, tmp_path: Path, vlm_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = RECIPES[name]
    paths = _build_header_folders(name, tmp_path / "folders", vlm_folder)
    # The example prompts wherever the tests run from; nothing else of the block is changed.
    args = cpu_block(recipe, {**paths, "recipes/prompts/": f"{ROOT}/recipes/prompts/"})
    assert args and not any("/tmp/tiny" in a for a in args), "every folder of the block is one the header builds"
    for expected in ("--trainer.accelerator=cpu", "--trainer.max_steps=2", "--model.generator.init_args.dtype=float32"):
        assert expected in args, expected
    overrides = dict(a[2:].split("=", 1) for a in args if a.startswith("--"))
    height = int(overrides["model.generator.init_args.height"])
    width = int(overrides["model.generator.init_args.width"])
    num_steps = int(overrides["model.rollout.num_steps"])

    # The replies the format reward is given.
    seen: list[list[str | None] | None] = []
    original = PromptRLFormat.__call__

    def recording(self, prompts, refined_prompts, images, replies=None):  # declares ``replies`` as the reward does
        seen.append(replies)
        return original(self, prompts, refined_prompts, images, replies=replies)

    monkeypatch.setattr(PromptRLFormat, "__call__", recording)
    outputs = [f"--trainer.logger.init_args.save_dir={tmp_path}/runs", f"--trainer.default_root_dir={tmp_path}/runs"]
    cli = main(["fit", "--config", str(recipe), *args, *outputs])
    assert cli.trainer.state.status == "finished"

    # C2 of both experts (float32 everywhere) and interleave parity within the recipe's own tolerance.
    rows = assert_joint_steps_green(cli)

    # Both experts fully fine-tuned: every weight of the DiT and of the language model trains, no adapter,
    # the vision tower frozen and in no optimizer.
    assert sorted(cli.model.trained) == ["llm", "transformer"]
    optimized = {id(p) for opt in cli.trainer.optimizers for group in opt.param_groups for p in group["params"]}
    dit = dict(cli.model.generator.model.named_parameters())
    assert dit and all(p.requires_grad for p in dit.values())
    assert not any("lora_" in n for n in dit), "full fine-tuning of the DiT attaches no adapter"
    llm = cli.model.llm
    tower = vision_tower(llm.model)
    assert tower is not None
    frozen = {id(p) for p in tower.parameters()}
    assert frozen and not any(p.requires_grad for p in tower.parameters()), "the vision tower is frozen"
    language = {n: p for n, p in llm.model.named_parameters() if id(p) not in frozen}
    assert language and all(p.requires_grad for p in language.values()), "every language-model weight trains"
    assert not any("lora_" in n for n in language), "full fine-tuning of the refiner attaches no adapter"
    trained = {id(p) for p in dit.values()} | {id(p) for p in language.values()}
    assert optimized == trained, "the optimizers hold exactly the two experts' weights, nothing of the tower"

    # The refiner's raw replies (before the <answer> parse) reach PromptRL's format reward, every sample refined.
    per_step = int(overrides["data.prompts_per_step"]) * int(overrides["data.samples_per_prompt"])
    assert seen and all(replies is not None for replies in seen), f"every call of the reward got replies: {seen}"
    # The last two calls are the training steps' (before them: the sanity check's validation batch).
    assert [len(replies) for replies in seen[-2:]] == [per_step, per_step], seen
    assert all(isinstance(reply, str) for replies in seen for reply in replies), "no sample skipped refinement"
    fmt = series(rows, "reward/promptrl_format")
    assert len(fmt) == 2 and all(0.0 <= v <= 1.0 for v in fmt), fmt
    assert len(series(rows, "reward/jpeg_incompressibility")) == 2

    # schedule.json is the schedule of diffusers' own pipeline of this folder for this size and step count.
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    pipeline_folder = overrides["model.pipeline_path"]
    expected = _pipeline_sigmas(name, pipeline_folder, height, width, num_steps)
    assert len(schedule["sigmas"]) == num_steps + 1
    torch.testing.assert_close(torch.tensor(schedule["sigmas"], dtype=torch.float64), expected, rtol=0, atol=1e-6)
    window = [int(v) for v in overrides["model.generator_algorithm.init_args.sde_window"].strip("[]").split(",")]
    assert schedule["sde_steps"] == list(range(*window))


# ------------------------------------------------------------------ the schedule at the recipes' real setting
def _image_tokens(folder: Path, height: int, width: int) -> int:
    """``latents.shape[1]`` of the pipeline's ``prepare_latents`` (the packed image sequence both pipelines
    pass to their mu), from the folder's VAE config as the pipelines' ``vae_scale_factor``."""
    vae = json.loads((folder / "vae" / "config.json").read_text())
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    # Both pipelines: height = 2 * (height // (vae_scale_factor * 2)), then 2x2 patches.
    return (2 * (height // (factor * 2)) // 2) * (2 * (width // (factor * 2)) // 2)


def _diffusers_sigmas(name: str, folder: Path, height: int, width: int, num_steps: int) -> torch.Tensor:
    """The sigmas the pipeline's ``__call__`` sets, by diffusers' own helpers in the same order: linspace
    sigmas, mu (``compute_empirical_mu`` for klein, ``calculate_shift`` from the scheduler config for FLUX.1),
    ``retrieve_timesteps``, on the folder's shipped scheduler config."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder), subfolder="scheduler")
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    tokens = _image_tokens(folder, height, width)
    if name == "klein":
        mu = compute_empirical_mu(image_seq_len=tokens, num_steps=num_steps)
        klein_retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    else:
        config = scheduler.config
        mu = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        flux_retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas.to(torch.float64)


@pytest.mark.parametrize("name", list(RECIPES))
def test_schedule_at_the_recipes_setting_is_diffusers_own(name: str) -> None:
    setting = _recipe_setting(RECIPES[name])
    assert setting == {"height": 1024, "width": 1024, "num_steps": 20}
    folder = SHIPPED_FOLDERS[name]
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert config["use_dynamic_shifting"] is True and config["shift"] == 3.0
    assert _image_tokens(folder, 1024, 1024) == 4096
    generator = GENERATORS[name](str(folder), height=1024, width=1024)
    ours = generator.schedule(20).sigmas
    expected = _diffusers_sigmas(name, folder, 1024, 1024, 20)
    assert ours.shape == (21,) and float(ours[0]) == 1.0 and float(ours[-1]) == 0.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    # Not linspace(1, 0) nor the static shift 3: the mu of 4096 tokens shapes it.
    linear = torch.linspace(1.0, 0.0, 21, dtype=torch.float64)
    static = FlowMatchEulerDiscreteScheduler(shift=3.0)
    static.set_timesteps(sigmas=np.linspace(1.0, 1 / 20, 20), device="cpu")
    assert (ours - linear).abs().max() > 0.05 and (ours - static.sigmas.to(torch.float64)).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_schedule_at_the_recipes_setting_is_a_real_pipeline_call(name: str, tmp_path: Path) -> None:
    """A tiny folder with the shipped scheduler config sampled at the real image's 4096 tokens (its VAE
    downsamples 2x, the real ones 8x: 256 px here is 1024 px there) for the recipe's 20 steps, stopped after
    its first step: the sigmas it set are the generator's at 1024 px on the shipped configs."""
    folder = SHIPPED_FOLDERS[name]
    build = make_flux2_klein_pipeline if name == "klein" else make_flux_pipeline
    shipped = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    tiny = with_scheduler(build(tmp_path / name), shipped)
    size = 256
    assert _image_tokens(tiny, size, size) == _image_tokens(folder, 1024, 1024) == 4096
    pipe = PIPELINES[name].from_pretrained(str(tiny))
    seq_lens: list[int] = []

    def stop(pipeline, step, timestep, kwargs):
        seq_lens.append(kwargs["latents"].shape[1])
        pipeline._interrupt = True  # the schedule is set; skip the other 19 transformer calls
        return {}

    extra = {"guidance_scale": 1.0} if name == "klein" else {}
    pipe(
        prompt="a red cat",
        height=size,
        width=size,
        num_inference_steps=20,
        max_sequence_length=16,
        output_type="latent",
        callback_on_step_end=stop,
        **extra,
    )
    assert seq_lens == [4096], "the pipeline's own image sequence length is the real 1024 px one"
    expected = pipe.scheduler.sigmas.to(torch.float64)
    ours = GENERATORS[name](str(folder), height=1024, width=1024).schedule(20).sigmas
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the recipes as written
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_as_written_resolves_to_promptrl_values(name: str) -> None:
    config = printed_config("--config", str(RECIPES[name]))
    model = config["model"]["init_args"]
    data = config["data"]["init_args"]
    generator = model["generator"]
    assert generator["class_path"].endswith(GENERATORS[name].__name__)
    assert model["mode"] == "joint"
    assert model["generator_algorithm"]["init_args"]["sde_window"] == ([0, 8] if name == "klein" else [0, 6])
    assert model["generator_algorithm"]["init_args"]["noise_level"] == 0.8
    assert model["rollout"]["num_steps"] == 20
    assert model["llm_optimizer"]["init_args"]["lr"] == 1e-6
    assert model["transformer_optimizer"]["init_args"]["lr"] == 2e-7
    assert generator["init_args"]["finetune"] == "full" and model["llm"]["init_args"]["finetune"] == "full"
    assert data["samples_per_prompt"] == 8 and data["num_skip_refinement"] == 0
    assert model["transformer_loss"]["kl_form"] == "promptrl"
    assert generator["init_args"]["height"] == generator["init_args"]["width"] == 1024
    if name == "klein":
        assert model["rollout"]["guidance_scale"] == 4.0, "true CFG at 4.0"
    else:
        assert generator["init_args"]["guidance_scale"] == 3.5, "dev's embedded guidance"
        assert model["rollout"]["guidance_scale"] == 1.0, "no CFG pass"
