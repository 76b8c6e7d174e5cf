"""Every GPU recipe fits the GPU it names, by ``python -m unirl_pl plan``; the plan counts the in-process reward
models and divides the step over the ranks.

- Per-rank sizes: ``step_sizes`` gives each rank ``1 / devices`` of the step (prompts, texts, refined rows,
  images), so a planner that planned every rank with the whole step fails here (fast).
- Reward models: PickScore's CLIP ViT-H/14 is built at its published size on the trainer's device; OCR
  (RapidOCR on onnxruntime) and the text rules hold nothing there; the reward phase's fake trace equals
  PickScore itself scoring real images with a tiny CLIP folder (fast).
- Fits: each shipped GPU recipe (``recipes/*.yaml`` with ``trainer.accelerator: gpu`` and a family
  generator) is planned at its own micro-batch and checkpointing (``--no-search``: one trace of the step)
  with the GPU its comments name ("one 80 GB GPU", "8 x 80 GB") and the plan command they give (Wan2.2's
  ``--pipeline-path``); every phase must stay within that GPU less the plan's 4 GiB reserve. One plan per
  recipe, about a minute of one core each (marked slow).
- Stand-ins: one real-size plan (``STAND_IN_CHECK``) is also traced block by block (``--trace-every-block``): every
  phase's bytes are equal (slow).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from unirl_pl.plan import run
from unirl_pl.plan.planner import Plan
from unirl_pl.plan.recipe import parsed_recipe, step_recipe
from unirl_pl.plan.rewards import planned_rewards
from unirl_pl.plan.step import step_sizes
from unirl_pl.plan.tracker import GiB

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
FAMILIES = (
    "SD3Generator", "FluxGenerator", "Flux2KleinGenerator", "WanGenerator", "ZImageGenerator", "QwenImageGenerator",
    "QwenImageEditPlusGenerator", "FluxKontextGenerator",
)  # fmt: skip
SHIPPED_GPU_RECIPES = {
    "sd35", "sd35_ocr", "sd35_pickscore", "flux", "wan_t2v", "wan22_t2v", "promptrl_klein", "promptrl_flux",
    "zimage", "zimage_turbo", "qwenimage", "wan22_ti2v", "promptrl_kontext", "qwenimage_edit_plus",
}  # fmt: skip


def gpu_recipes() -> list[str]:
    """The top-level recipes that train a family generator on GPUs (overlays and CPU recipes are not)."""
    names = []
    for path in sorted(RECIPES.glob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        generator = ((config.get("model") or {}).get("init_args") or {}).get("generator") or {}
        accelerator = (config.get("trainer") or {}).get("accelerator")
        if accelerator == "gpu" and str(generator.get("class_path", "")).endswith(FAMILIES):
            names.append(path.stem)
    return names


def named_gpu(name: str) -> tuple[int, float]:
    """(GPUs, GB each) the recipe's comments name: its header first ("one 80 GB GPU", "8 x 80 GB"), else the
    comment its plan result is given in."""
    text = (RECIPES / f"{name}.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    for source in (header, comments):
        many = re.search(r"(\d+)\s*x\s*(\d+)\s*GB", source)
        if many:
            return int(many[1]), float(many[2])
        one = re.search(r"\bone (\d+)\s*GB GPU", source)
        if one:
            return 1, float(one[1])
    raise AssertionError(f"recipes/{name}.yaml names no GPU (e.g. 'one 80 GB GPU' or '8 x 80 GB') to plan it for")


def plan_command_extras(name: str) -> list[str]:
    """The model folders the recipe's own plan command passes (Wan2.2's ``--pipeline-path``): its recipe
    names no folder, and the family's default config is another model."""
    text = (RECIPES / f"{name}.yaml").read_text()
    command = re.search(rf"plan --config recipes/{re.escape(name)}\.yaml([^`\n]*)", text)
    found = re.findall(r"(--(?:pipeline|llm)-path)[ =](\S+)", command[1] if command else "")
    return [part for pair in found for part in pair]


def plan_of(name: str) -> tuple[Plan, float]:
    """The recipe's plan at its own setting on the GPU it names, and its seconds."""
    _, gb = named_gpu(name)
    start = time.monotonic()
    plan = run(
        ["--config", str(RECIPES / f"{name}.yaml"), "--gpu-memory-gb", str(gb), "--no-search", "--quiet"]
        + plan_command_extras(name)
    )
    return plan, time.monotonic() - start


# ------------------------------------------------------------------ fast: per-rank sizes, reward models


def test_per_rank_sizes_divide_the_step_over_the_devices():
    """Each rank plans prompts_per_step / devices prompts and what follows from them; a planner that gives
    every rank the whole step (the sizes of one device) fails. ``trainer.devices`` is the default."""
    config = parsed_recipe(["--config", str(RECIPES / "sd35.yaml"), "--data.prompts_per_step=16"])
    whole = step_sizes(step_recipe(config, devices=1), refines=True, prompt_tokens=128)
    assert (whole.prompts, whole.texts, whole.refined, whole.images) == (16, 128, 112, 128)
    for devices in (2, 4, 8, 16):
        recipe = step_recipe(config, devices=devices)
        assert recipe.devices == devices
        sizes = step_sizes(recipe, refines=True, prompt_tokens=128)
        for field in ("prompts", "texts", "refined", "images"):
            assert getattr(sizes, field) * devices == getattr(whole, field), (field, devices)
        # What does not scale with the ranks stays: the recorded steps, the token counts.
        assert (sizes.sde_steps, sizes.new_tokens, sizes.prompt_tokens) == (
            whole.sde_steps,
            whole.new_tokens,
            whole.prompt_tokens,
        )
    wan22 = step_recipe(parsed_recipe(["--config", str(RECIPES / "wan22_t2v.yaml")]))  # trainer.devices: 8, FSDP2
    assert wan22.devices == 8 and wan22.fsdp
    sizes = step_sizes(wan22, refines=True, prompt_tokens=128)
    assert (sizes.prompts, sizes.images) == (1, 4), "8 prompts a step over 8 ranks: one prompt's 4 videos each"


def test_plan_counts_the_in_process_reward_models():
    """sd35_pickscore's PickScore runs on the trainer's GPU: its CLIP ViT-H/14 is built at the published size
    (986M parameters) in the recipe's float32; OCR and the format rule hold nothing on the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pick = step_recipe(parsed_recipe(["--config", str(RECIPES / "sd35_pickscore.yaml")]))
    (term,) = planned_rewards(pick.rewards, FakeTensorMode())
    assert term.name == "pickscore" and term.on_device and term.batch_size == 32
    assert abs(term.parameters - 986.1e6) <= 0.01 * 986.1e6, term.parameters
    assert abs(term.weight_bytes - 4 * term.parameters) <= 0.01 * term.weight_bytes  # float32
    assert "ViT-H/14" in term.line() and "GiB" in term.line()
    ocr = step_recipe(parsed_recipe(["--config", str(RECIPES / "sd35_ocr.yaml")]))
    terms = planned_rewards(ocr.rewards, FakeTensorMode())
    assert [t.name for t in terms] == ["ocr", "refiner_format"] and not any(t.on_device for t in terms)
    assert "onnxruntime" in terms[0].line()
    # A scorer moved off the trainer's device (reward_args device) is not counted on it.
    (moved,) = planned_rewards({"pickscore": {"device": "cpu"}}, FakeTensorMode())
    assert not moved.on_device


def test_reward_phase_trace_matches_the_reward_on_real_tensors(tmp_path):
    """The plan's reward phase (a fake CLIP, the host processor stood in for) tracks the same bytes, within
    10%, as PickScore itself scoring real images with a real tiny CLIP folder and its processor."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from tests.pipelines import clip_tokenizer
    from unirl_pl.plan.rewards import reward_models, score
    from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker
    from unirl_pl.rewards.clip_models import PickScore

    tok, size = clip_tokenizer(), 32
    common = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
    text = common | {"vocab_size": len(tok), "max_position_embeddings": 77, "eos_token_id": tok.eos_token_id}
    text |= {"bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    vision = common | {"image_size": size, "patch_size": 8}
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(tmp_path)
    image = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    CLIPProcessor(image_processor=image, tokenizer=tok).save_pretrained(tmp_path)
    args = {"pretrained_path": str(tmp_path), "processor_path": str(tmp_path), "batch_size": 4}
    prompts = ["a red cat"] * 5 + ["a blue dog"] * 5

    real = PickScore(**args)
    images = torch.rand(10, 3, 64, 64)
    tracker = PlanMemTracker()
    tracker.track_external(real.model, images)
    with tracker:
        real.score_images(images, prompts)
    expected = tracker.peak()

    mode = FakeTensorMode()
    planned = planned_rewards({"pickscore": args}, mode)
    with mode, AllRowsReal():
        images = torch.zeros(10, 3, 64, 64)
        tracker = PlanMemTracker()
        tracker.track_external(*reward_models(planned), images)
        with tracker:
            score(planned, images, prompts)
    traced = tracker.peak()
    assert traced.weights == expected.weights == planned[0].weight_bytes
    assert abs(traced.total - expected.total) <= 0.10 * expected.total, (traced, expected)
    # The scoring's own bytes (activations, pixel copies), without the model and the images both sides hold.
    own = [u.activations + u.temporaries for u in (traced, expected)]
    assert abs(own[0] - own[1]) <= 0.10 * own[1], (traced, expected)


def test_every_gpu_recipe_names_its_gpu_and_is_planned_here():
    """The shipped GPU recipes are all found and each names the GPU (and count) the plan checks it against."""
    found = gpu_recipes()
    assert SHIPPED_GPU_RECIPES <= set(found), found
    for name in found:
        devices, gb = named_gpu(name)
        config = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        assert devices == config["trainer"].get("devices", 1), name
        assert gb > 4
    assert plan_command_extras("wan22_t2v") == ["--pipeline-path", "Wan2.2-T2V-A14B-Diffusers"]


# ------------------------------------------------------------------ slow: one plan per recipe


STAND_IN_CHECK = "flux"
"""The recipe whose plan is also traced block by block: FLUX.1's 19 double-stream and 38 single-stream blocks trained
with LoRA under gradient checkpointing (stand-ins in forward and backward, two stacks back to back), its T5 and CLIP
text encoders, and the refiner's decode with its KV cache and its LoRA loss. FSDP2 is checked on tiny models
(``tests/test_plan_blocks.py``) and on every recipe by ``scripts/plan_stand_ins.py``. Its fit is checked by the same
test, so that one worker plans it once."""


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in gpu_recipes() if name != STAND_IN_CHECK])
def test_recipe_fits_the_gpu_it_names(name):
    """At its own micro_batch_size and gradient checkpointing, every phase of the recipe's step (in-process
    reward models included) stays within the GPU it names less the 4 GiB reserve, on each of its ranks."""
    assert_fits(name, *plan_of(name))


def assert_fits(name: str, plan: Plan, seconds: float) -> None:
    """``test_recipe_fits_the_gpu_it_names``'s checks of recipe ``name``'s plan (``seconds`` of planning)."""
    devices, gb = named_gpu(name)
    assert plan.devices == devices and plan.budget == int((gb - 4) * GiB)
    candidate = plan.recipe_candidate
    over = {phase: round(u.total / GiB, 1) for phase, u in candidate.phases.items() if u.total > plan.budget}
    phase, peak = candidate.peak
    print(f"{name}: peak {peak.total / GiB:.1f} GiB in {phase}, budget {plan.budget / GiB:.0f} GiB, {seconds:.0f} s")
    assert not over, f"recipes/{name}.yaml does not fit {devices} x {gb:.0f} GB: over budget (GiB) {over}"
    on_device = [t for t in plan.rewards if t.on_device]
    if on_device:
        # The reward models' weights are in every phase, and their scoring is a phase of its own.
        assert "reward" in candidate.phases
        reward_bytes = sum(t.weight_bytes for t in on_device)
        assert all(u.weights >= reward_bytes for u in candidate.phases.values())
    else:
        assert "reward" not in candidate.phases
    if name == "sd35_pickscore":
        assert [t.name for t in on_device] == ["pickscore"]


@pytest.mark.slow
def test_stand_ins_give_a_real_size_plan_the_bytes_of_tracing_every_block():
    """The block stand-ins (``unirl_pl.plan.blocks``) change no byte of a real-size plan: every phase of
    ``STAND_IN_CHECK``'s step equals the plan that traces every block (``--trace-every-block``); and that recipe
    fits the GPU it names (``test_recipe_fits_the_gpu_it_names``'s checks)."""
    plan, seconds = plan_of(STAND_IN_CHECK)
    assert_fits(STAND_IN_CHECK, plan, seconds)
    _, gb = named_gpu(STAND_IN_CHECK)
    full = run(
        ["--config", str(RECIPES / f"{STAND_IN_CHECK}.yaml"), "--gpu-memory-gb", str(gb), "--no-search", "--quiet"]
        + plan_command_extras(STAND_IN_CHECK)
        + ["--trace-every-block"]
    )
    assert plan.stood_in > 100 and full.stood_in == 0
    assert plan.recipe_candidate.phases == full.recipe_candidate.phases
    assert plan.held_lm_graph == full.held_lm_graph
