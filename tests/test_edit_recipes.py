"""The two editing recipes (``recipes/promptrl_kontext.yaml``, ``recipes/qwenimage_edit_plus.yaml``).

* (integration) Each runs the CPU block its header documents (the tiny folders built by the commands the header
  names, the example prompt file of image rows): two joint steps with C2 green for both experts in float32,
  interleave parity within the recipe's tolerance, the refiner given every refined row's source image and the
  generator every sample's source latents.
* The recipes as written (GPU settings) resolve to their references' values (PromptRL's ``edit_grpo.sh`` at
  G-U-N/UniRL 53c28c9; Flow-Factory's Qwen-Image-Edit-Plus GRPO LoRA example at a0b2bc5; docs/reproduce.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ROOT, assert_joint_steps_green, printed_config
from tests.pipelines_edit import make_flux_kontext_pipeline
from tests.pipelines_qwen_edit import make_qwenimage_edit_plus_pipeline
from tests.test_promptrl_recipes import header_builds
from tests.test_rewards_recipes import cpu_block
from tests.vlm_lm import make_vlm
from unirl_pl.cli import main
from unirl_pl.loops import ARDecode

RECIPES = {
    "kontext": ROOT / "recipes" / "promptrl_kontext.yaml",
    "qwen_edit": ROOT / "recipes" / "qwenimage_edit_plus.yaml",
}
BUILDERS = {"flux_kontext": make_flux_kontext_pipeline, "qwenimage_edit_plus": make_qwenimage_edit_plus_pipeline}


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_vlm("qwen2_5_vl", tmp_path_factory.mktemp("qwen25vl"))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_edit_recipe_runs_its_header_cpu_block_with_gates_green(
    name: str, tmp_path: Path, vlm_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = RECIPES[name]
    paths = {}
    for module, arg, folder in header_builds(recipe):
        paths[folder] = vlm_folder if module == "tests.vlm_lm" else str(BUILDERS[arg](tmp_path / arg))
    args = cpu_block(recipe, {**paths, "recipes/prompts/": f"{ROOT}/recipes/prompts/"})
    assert args and not any("/tmp/tiny" in a for a in args), "every folder of the block is one the header builds"
    assert f"--data.prompts={ROOT}/recipes/prompts/edit_example.jsonl" in args

    # What the refiner and the generator are given.
    refiner_images: list[Any] = []
    original_sample = ARDecode.sample

    def recording(self, prompts, *rest, images=None, **kwargs):  # noqa: ANN001, ANN202 - the loop's own signature
        refiner_images.append((len(prompts), images))
        return original_sample(self, prompts, *rest, images=images, **kwargs)

    monkeypatch.setattr(ARDecode, "sample", recording)
    outputs = [f"--trainer.logger.init_args.save_dir={tmp_path}/runs", f"--trainer.default_root_dir={tmp_path}/runs"]
    cli = main(["fit", "--config", str(recipe), *args, *outputs])
    assert cli.trainer.state.status == "finished"

    assert_joint_steps_green(cli)
    # Every refiner call (rollout, validation, the parity probe) carried one source image per prompt.
    assert refiner_images and all(
        images is not None and len(images) == n and all(isinstance(i, torch.Tensor) for i in images)
        for n, images in refiner_images
    ), [(n, None if i is None else len(i)) for n, i in refiner_images]
    # The feature cache holds each distinct source's latents once, keyed by its image.
    assert any(key[2].startswith("\0") for key in cli.model.conditioning.cache._store), "no source latents encoded"


def test_promptrl_kontext_as_written_resolves_to_promptrl_values() -> None:
    """Each value against G-U-N/UniRL 53c28c9 (docs/reproduce.md, "recipes/promptrl_kontext.yaml")."""
    config = printed_config("--config", str(RECIPES["kontext"]))
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    generator, llm = model["generator"], model["llm"]["init_args"]
    assert generator["class_path"].endswith("FluxKontextGenerator") and model["mode"] == "joint"
    assert generator["init_args"]["guidance_scale"] == 2.5 and model["rollout"]["guidance_scale"] == 1.0
    assert generator["init_args"]["height"] == generator["init_args"]["width"] == 1024
    assert generator["init_args"]["source_size"] == [1024, 1024]
    assert generator["init_args"]["finetune"] == "full" and llm["finetune"] == "full"
    assert llm["load_image_processor"] is True and llm["image_min_pixels"] == llm["image_max_pixels"] == 200704
    assert model["rollout"]["num_steps"] == 8 and model["rollout"]["max_new_tokens"] == 512
    algorithm = model["generator_algorithm"]["init_args"]
    assert algorithm["sde_window"] == [0, 4] and algorithm["noise_level"] == 0.8
    assert (
        model["llm_optimizer"]["init_args"]["lr"] == 3e-7 and model["transformer_optimizer"]["init_args"]["lr"] == 2e-7
    )
    assert data["samples_per_prompt"] == 8 and data["num_skip_refinement"] == 2 and data["prompts_per_step"] == 6
    assert model["transformer_loss"]["kl_form"] == "promptrl" and model["transformer_loss"]["beta"] == 0.01
    assert model["transformer_loss"]["clip_eps"] == 1e-4 and model["llm_loss"]["beta"] == 0.01
    assert set(model["rewards"]) == {"edit_judge", "promptrl_edit_format"}
    assert model["reward_args"]["edit_judge"]["prompt"] == "original", "EditReward is given the original instruction"
    assert "image editing prompt" in llm["chat"].get("init_args", llm["chat"])["instruction"]


def test_qwenimage_edit_plus_as_written_resolves_to_flow_factory_values() -> None:
    """Each value against Flow-Factory a0b2bc5 (docs/reproduce.md, "recipes/qwenimage_edit_plus.yaml")."""
    config = printed_config("--config", str(RECIPES["qwen_edit"]))
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    generator = model["generator"]["init_args"]
    assert model["generator"]["class_path"].endswith("QwenImageEditPlusGenerator")
    assert generator["lora_rank"] == 64 and generator["lora_alpha"] == 128.0
    assert generator["height"] == generator["width"] == 384 and generator["source_size"] == [384, 384]
    assert model["rollout"]["num_steps"] == 10 and model["rollout"]["guidance_scale"] == 4.0
    algorithm = model["generator_algorithm"]["init_args"]
    assert algorithm["window_size"] == 1 and algorithm["window_range"] == [1, 4] and algorithm["noise_level"] == 1.0
    assert data["samples_per_prompt"] == 16 and data["prompts_per_step"] == 48
    optimizer = model["transformer_optimizer"]["init_args"]
    assert optimizer["lr"] == 3e-4 and optimizer["weight_decay"] == 1e-4
    loss = model["transformer_loss"]
    assert loss["clip_eps"] == 1e-4 and loss["beta"] == 0.0 and loss["grad_clip"] == 1.0 and loss["mini_batches"] == 2
    assert model["advantage"]["clip_max"] == 5.0 and model["eval_sampler"]["num_steps"] == 40
    assert model["ema"]["init_args"]["decay"] == 0.9 and model["ema"]["init_args"]["every_n_steps"] == 4
