"""The family recipes' published settings that are not schedules: LoRA targets, VAE precision, no shift
override (the schedule comes from the pipeline folder, see tests/test_schedules.py)."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import ROOT
from tests.pipelines import make_flux_pipeline
from unirl_pl.generators import FluxGenerator

FAMILY_RECIPES = ["sd35", "flux", "wan_t2v"]


def _model(recipe: str) -> dict:
    return yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())["model"]["init_args"]


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_family_recipes_take_the_schedule_from_the_pipeline(recipe):
    assert "shift" not in _model(recipe)["rollout"], "a recipe shift would override the pipeline's scheduler"


@pytest.mark.parametrize("recipe", ["flux", "wan_t2v"])
def test_flux_and_wan_decode_in_float32_as_flow_grpo_does(recipe):
    assert _model(recipe)["generator"]["init_args"]["vae_dtype"] == "float32"


def test_flux_lora_adapts_attention_and_double_block_feed_forward(tmp_path):
    generator = FluxGenerator(str(make_flux_pipeline(tmp_path / "flux")), height=32, width=32, dtype="float32")
    generator.build()
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in generator.model.named_modules() if name.endswith("lora_A")}
    block = "transformer_blocks.0."
    for target in (
        "attn.to_q",
        "attn.add_k_proj",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ):
        assert any(name.endswith(block + target) for name in adapted), target
    assert not any("single_transformer_blocks.0.proj_mlp" in name for name in adapted), (
        "single blocks' MLP stays frozen"
    )
    flux = _model("flux")["generator"]["init_args"]
    assert (flux["lora_rank"], flux["lora_alpha"]) == (64, 128.0), "Flow-GRPO's FLUX LoRA: r 64, alpha 128"
