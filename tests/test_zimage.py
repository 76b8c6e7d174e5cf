"""Z-Image and Z-Image-Turbo against diffusers' own ``ZImagePipeline`` on tiny folders in the published layout.

Every reference here is the pipeline's computation, not a formula of ours: its ``encode_prompt`` for the
per-prompt caption features, its transformer call (timestep ``(1000 - t) / 1000``, output negated) for the
velocity, its sampling loop (default sigmas on its scheduler, CFG ``pos + w (pos - neg)``, Euler steps, VAE
scale and shift) for whole samples, its scheduler's sigmas and the ``mu`` it passes for the schedule, and its
``load_lora_weights`` for the exported adapter. The recipes' CPU blocks are read from their headers and run.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, built_generator, read_metrics, series
from tests.pipelines import (
    ZIMAGE_SCHEDULER,
    ZIMAGE_TEXT_WIDTH,
    make_zimage_pipeline,
    random_latents,
    with_scheduler,
)
from unirl_pl.cli import main
from unirl_pl.generators import ZImageGenerator, load_generator
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.plan.models import SHIPPED

TOKENS = 32  # max_sequence_length: the chat template plus a short prompt fit
SIZE = {"height": 32, "width": 32}
TEXTS = ["a red cat on the left", "b", "two big blue squares"]


def _generator(folder: Path, **overrides: object) -> ZImageGenerator:
    return built_generator(folder, ZImageGenerator, TOKENS, SIZE, **overrides)


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_zimage_pipeline(tmp_path_factory.mktemp("zimage"))


@pytest.fixture(scope="module")
def turbo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_zimage_pipeline(tmp_path_factory.mktemp("zimage_turbo"), turbo=True, seed=1)


@pytest.fixture(scope="module")
def base(base_folder: Path) -> ZImageGenerator:
    return _generator(base_folder)


@pytest.fixture(scope="module")
def pipe(base_folder: Path) -> ZImagePipeline:
    return ZImagePipeline.from_pretrained(str(base_folder))


def _perturb_lora(generator: ZImageGenerator) -> None:
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


def _pipeline_velocity(
    pipe: ZImagePipeline, latents: torch.Tensor, sigma: torch.Tensor, texts: list[str]
) -> torch.Tensor:
    """The velocity as ``ZImagePipeline.__call__`` computes it for one unguided step: its per-prompt embeddings,
    the latents as a list of (C, 1, h, w), ``(1000 - t) / 1000`` of the scheduler's ``t = sigma * 1000``, and
    the stacked output negated (what its scheduler steps with)."""
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, max_sequence_length=TOKENS)
        timestep = (sigma * 1000).to(torch.float32)
        out = pipe.transformer(
            list(latents.unsqueeze(2).unbind(0)), (1000 - timestep) / 1000, embeds, return_dict=False
        )[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


# ------------------------------------------------------------------ the folder
def test_fixture_has_the_published_layout(base_folder: Path, turbo_folder: Path) -> None:
    """The tiny folders name the published components (``Qwen3Model`` as the text encoder) and carry the
    published scheduler configs: Z-Image's shift 6.0, Turbo's 3.0, both fixed."""
    shipped = json.loads((SHIPPED / "Z-Image" / "model_index.json").read_text())
    for folder, name in ((base_folder, "Z-Image"), (turbo_folder, "Z-Image-Turbo")):
        index = json.loads((folder / "model_index.json").read_text())
        for component in ("scheduler", "text_encoder", "transformer", "vae"):
            assert index[component] == shipped[component], component
        assert index["_class_name"] == shipped["_class_name"] == "ZImagePipeline"
        ours = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        published = json.loads((SHIPPED / name / "scheduler" / "scheduler_config.json").read_text())
        assert {key: ours[key] for key in published} == published
    assert ZIMAGE_SCHEDULER["shift"] == 6.0


def test_turbo_is_told_apart_and_refuses_guidance(base_folder: Path, turbo_folder: Path) -> None:
    assert ZImageGenerator(str(turbo_folder), **SIZE).is_distilled
    assert not ZImageGenerator(str(base_folder), **SIZE).is_distilled
    assert ZImageGenerator(str(SHIPPED / "Z-Image-Turbo")).is_distilled
    assert not ZImageGenerator(str(SHIPPED / "Z-Image")).is_distilled
    turbo = ZImageGenerator(str(turbo_folder), **SIZE)
    with pytest.raises(ValueError, match=r"^model.rollout.guidance_scale=5.0: .*step-distilled Z-Image-Turbo.*3.0"):
        turbo.check_guidance(5.0, "model.rollout.guidance_scale")
    turbo.check_guidance(1.0, "model.rollout.guidance_scale")
    ZImageGenerator(str(base_folder), **SIZE).check_guidance(5.0, "model.rollout.guidance_scale")
    # The setting wins over the folder, both ways.
    ZImageGenerator(str(turbo_folder), distilled=False).check_guidance(5.0, "model.rollout.guidance_scale")
    with pytest.raises(ValueError, match=r"\(distilled: true\)"):
        ZImageGenerator(str(base_folder), distilled=True).check_guidance(5.0, "model.eval_sampler.guidance_scale")


# ------------------------------------------------------------------ conditioning and velocity
def test_features_are_the_pipelines_encode_prompt(base: ZImageGenerator, pipe: ZImagePipeline) -> None:
    cond = base.encode(TEXTS)
    assert set(cond) == {"hidden", "mask"} and cond["hidden"].shape == (len(TEXTS), TOKENS, ZIMAGE_TEXT_WIDTH)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(list(TEXTS), do_classifier_free_guidance=False, max_sequence_length=TOKENS)
    for row, embeds in enumerate(expected):
        length = int(cond["mask"][row].sum())
        assert length == embeds.shape[0] and bool((cond["mask"][row, :length] == 1).all())
        torch.testing.assert_close(cond["hidden"][row, :length], embeds, rtol=0, atol=1e-6)
        assert not cond["hidden"][row, length:].any(), "the padding is zeroed"
    assert len({int(n) for n in cond["mask"].sum(1)}) == 3, "each prompt at its own length"
    alone = base.encode([TEXTS[1]])
    torch.testing.assert_close(alone["hidden"][0], cond["hidden"][1], rtol=0, atol=1e-6)


def test_velocity_is_the_pipelines_transformer_call(base: ZImageGenerator, pipe: ZImagePipeline) -> None:
    """``velocity`` is the pipeline's negated transformer output at ``(1000 - t) / 1000`` bit for bit, and a
    row's velocity does not depend on the captions of the rest of its batch (each sample's own length)."""
    assert base.latent_shape == (4, 16, 16), "the VAE's 4 channels at 32 px / 2"
    latents = random_latents(base.latent_shape, 3)
    sigma = torch.tensor([0.95, 0.5, 0.1])
    expected = _pipeline_velocity(pipe, latents, sigma, TEXTS)
    cond = base.encode(TEXTS)
    torch.testing.assert_close(base.velocity(latents, sigma, cond), expected, rtol=0, atol=0)
    assert expected.abs().mean() > 0.1, "the tiny model predicts something"
    worst = max(
        (
            base.velocity(latents[i : i + 1], sigma[i : i + 1], {k: v[i : i + 1] for k, v in cond.items()})[0]
            - expected[i]
        )
        .abs()
        .max()
        .item()
        for i in range(3)
    )
    assert worst <= 1e-5, "a row's velocity does not depend on its batch"


# ------------------------------------------------------------------ schedule, guidance and decode
@pytest.mark.parametrize("num_steps", [4, 7])
def test_schedule_is_the_sigmas_of_a_real_pipeline_call(
    base_folder: Path, turbo_folder: Path, pipe: ZImagePipeline, num_steps: int
) -> None:
    """Z-Image (shift 6.0) and Turbo (3.0): the sigmas the pipeline's scheduler holds after a real call, at two
    sizes; the loop samples on them."""
    for folder, reference in ((base_folder, pipe), (turbo_folder, ZImagePipeline.from_pretrained(str(turbo_folder)))):
        for height, width in [(32, 32), (64, 32)]:
            generator = load_generator(folder, height=height, width=width)
            reference(
                prompt="a red cat", height=height, width=width, num_inference_steps=num_steps, guidance_scale=0.0,
                max_sequence_length=TOKENS, output_type="latent",
            )  # fmt: skip
            expected = reference.scheduler.sigmas.to(torch.float64)
            ours = generator.schedule(num_steps)
            assert ours.sigmas.shape == (num_steps + 1,) and ours.sigmas[0] == 1.0 and ours.sigmas[-1] == 0.0
            torch.testing.assert_close(ours.sigmas, expected, rtol=0, atol=0)
            assert "mu" not in ours.details, "a fixed shift: the scheduler reads no mu"
            loop = DiffusionDenoise(generator, RolloutConfig(num_steps=num_steps))
            torch.testing.assert_close(loop.sigmas(num_steps), ours.sigmas)


def test_dynamic_shifting_takes_the_pipelines_mu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a dynamically shifting scheduler the pipeline passes ``mu = calculate_shift(tokens)``: the schedule
    (and its ``details``, written to ``schedule.json``) has that mu and the sigmas it gives, at two sizes."""
    folder = with_scheduler(
        make_zimage_pipeline(tmp_path / "dynamic"),
        {**ZIMAGE_SCHEDULER, "_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True},
    )
    reference = ZImagePipeline.from_pretrained(str(folder))
    seen: list[float] = []
    set_timesteps = reference.scheduler.set_timesteps

    @functools.wraps(set_timesteps)  # the pipeline inspects its signature for `sigmas`
    def spy(*args, **kwargs):
        seen.append(kwargs["mu"])
        return set_timesteps(*args, **kwargs)

    monkeypatch.setattr(reference.scheduler, "set_timesteps", spy)
    mus = []
    for height, width in [(32, 32), (64, 64)]:
        reference(
            prompt="a red cat", height=height, width=width, num_inference_steps=5, guidance_scale=0.0,
            max_sequence_length=TOKENS, output_type="latent",
        )  # fmt: skip
        ours = load_generator(folder, height=height, width=width).schedule(5)
        assert ours.details["mu"] == seen[-1]
        torch.testing.assert_close(ours.sigmas, reference.scheduler.sigmas.to(torch.float64), rtol=0, atol=0)
        mus.append(ours.details["mu"])
    assert mus[1] > mus[0], "mu grows with the image's token count"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["base", "turbo"])
def test_sampling_and_decode_reproduce_the_pipeline(
    variant: str, base: ZImageGenerator, pipe: ZImagePipeline, turbo_folder: Path
) -> None:
    """Four ODE steps through the loop and ``decode`` equal ``pipe(...)`` from the same noise, its latents after
    every step and its images: the base model guided at the pipeline's 4.0 (``model.rollout.guidance_scale``
    5.0: the pipeline's ``pos + w (pos - neg)`` is ``neg + (w + 1) (pos - neg)``), Turbo unguided (0.0 there,
    1.0 here)."""
    generator, reference, theirs, ours = base, pipe, 4.0, 5.0
    if variant == "turbo":
        generator = _generator(turbo_folder)
        reference, theirs, ours = ZImagePipeline.from_pretrained(str(turbo_folder)), 0.0, 1.0
    noise = random_latents(generator.latent_shape, 2, seed=3)
    texts = TEXTS[:2]
    steps: list[torch.Tensor] = []

    def capture(_pipe, _i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return {}

    images = reference(
        prompt=list(texts), latents=noise.clone(), num_inference_steps=4, guidance_scale=theirs,
        max_sequence_length=TOKENS, output_type="pt", callback_on_step_end=capture, **SIZE,
    ).images  # fmt: skip
    config = RolloutConfig(num_steps=4, guidance_scale=ours)
    loop = DiffusionDenoise(generator, config)
    cond = generator.encode(texts)
    uncond = generator.encode([""]) if config.guided else None
    assert config.guided == (variant == "base")
    sigmas = loop.sigmas(4).float()
    x = noise.clone()
    with torch.no_grad():
        for i in range(4):
            x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, uncond)
            torch.testing.assert_close(x, steps[i], rtol=0, atol=1e-5)
    torch.testing.assert_close(generator.decode(x), images, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ LoRA
def test_lora_targets_and_export_load_through_the_pipeline(base_folder: Path, tmp_path: Path) -> None:
    """Flow-Factory's targets in every block (main layers and both refiners); the exported file changes the
    pipeline's output through ``load_lora_weights`` exactly as trained, and the pipeline without it is the
    adapter-disabled reference."""
    generator = _generator(base_folder)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in generator.model.named_modules() if name.endswith("lora_A")}
    for block in ("layers.0", "layers.1", "noise_refiner.0", "context_refiner.0"):
        for target in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"):
            assert f"{block}.{target}" in adapted, (block, target)
        for target in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            assert f"{block}.{target}" in adapted, (block, target)
    assert len(adapted) == 4 * 7, "no other module: the modulation, embedders and final layer stay frozen"

    _perturb_lora(generator)
    latents, sigma = random_latents(generator.latent_shape, 2), torch.tensor([0.7, 0.2])
    cond = generator.encode(TEXTS[:2])
    trained = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        reference = generator.velocity(latents, sigma, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = ZImagePipeline.from_pretrained(str(base_folder))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS[:2]), reference, rtol=0, atol=1e-5)
    pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS[:2]), trained, rtol=0, atol=1e-5)
    fresh = _generator(base_folder)
    fresh.load_adapter(str(tmp_path))
    torch.testing.assert_close(fresh.velocity(latents, sigma, cond), trained, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the recipes' CPU blocks
def _header_overrides(recipe: Path, folders: dict[str, Path]) -> list[str]:
    """The CPU overrides the recipe's header lists (its ``#   --...`` lines), with the tiny folders it names
    replaced by this test's."""
    lines = [line[1:].strip() for line in recipe.read_text().splitlines() if line.startswith("#   ")]
    text = " ".join(line for line in lines if line.startswith(("--", "'--")))
    for placeholder in sorted(folders, key=len, reverse=True):
        text = text.replace(placeholder, str(folders[placeholder]))
    return shlex.split(text)


@pytest.fixture(scope="module")
def refiner(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen2_chat_lm(tmp_path_factory.mktemp("qwen"))


@pytest.mark.integration
@pytest.mark.parametrize("name", ["zimage", "zimage_turbo"])
def test_recipe_header_cpu_block_trains_two_steps_with_gates_green(
    name: str, tmp_path: Path, base_folder: Path, turbo_folder: Path, refiner: str
) -> None:
    recipe = ROOT / "recipes" / f"{name}.yaml"
    folders = {"/tmp/tiny-zimage": base_folder, "/tmp/tiny-zimage-turbo": turbo_folder, "/tmp/tiny-qwen": Path(refiner)}
    overrides = _header_overrides(recipe, folders)
    assert f"--model.pipeline_path={turbo_folder if name == 'zimage_turbo' else base_folder}" in overrides
    outputs = [
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_progress_bar=false",
    ]
    cli = main(["fit", "--config", str(recipe), *overrides, *outputs])
    generator = cli.model.generator
    assert isinstance(generator, ZImageGenerator) and generator.is_distilled == (name == "zimage_turbo")
    rows = read_metrics(cli)
    assert len(series(rows, "reward/mean")) == 2
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert max(series(rows, "c2/transformer_max_abs_diff")) <= 1e-5
    parity = series(rows, "parity/max_abs_diff")
    assert parity and max(parity) <= 1e-5, "interleave parity ran and is green"
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    assert schedule["sigmas"] == generator.schedule(4).sigmas.tolist(), "the pipeline's own schedule"
    assert cli.model.ledger["transformer"] == 2 * cli.model.losses["transformer"].mini_batches


@pytest.mark.integration
def test_a_fit_refuses_guidance_on_turbo(tmp_path: Path, turbo_folder: Path) -> None:
    recipe = ROOT / "recipes" / "zimage_turbo.yaml"
    overrides = _header_overrides(recipe, {"/tmp/tiny-zimage-turbo": turbo_folder, "/tmp/tiny-qwen": tmp_path})
    with pytest.raises(ValueError, match=r"model.rollout.guidance_scale=5.0: .*step-distilled Z-Image-Turbo"):
        main(["--config", str(recipe), *overrides, "--model.rollout.guidance_scale=5.0"], run=False)


# ------------------------------------------------------------------ plan
@pytest.mark.slow
def test_plan_builds_z_image_at_its_published_size() -> None:
    """The shipped Z-Image configs build the published sizes (a 6.15B DiT, the Qwen3-4B encoder as the
    pipeline's ``Qwen3Model``), and the plan's fake generator encodes and predicts at 512 px through the same
    family code (every caption at its full 512 tokens: the plan's tokenizer pads none away)."""
    from diffusers import ZImageTransformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import Qwen3Model

    from unirl_pl.plan.models import DEFAULT_PIPELINES, build_generator, meta_model
    from unirl_pl.plan.phases import text_encode
    from unirl_pl.plan.tracker import AllRowsReal

    folder = SHIPPED / DEFAULT_PIPELINES["ZImageGenerator"]
    dit = meta_model(ZImageTransformer2DModel, folder / "transformer", torch.bfloat16)
    qwen = meta_model(Qwen3Model, folder / "text_encoder", torch.bfloat16)
    assert round(sum(p.numel() for p in dit.parameters()) / 1e9, 2) == 6.15
    assert round(sum(p.numel() for p in qwen.parameters()) / 1e9, 2) == 4.02
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    generator, _ = build_generator(ZImageGenerator, {"height": 512, "width": 512}, folder, mode)
    assert generator.latent_shape == (16, 64, 64) and not generator.is_distilled
    with mode, AllRowsReal():
        cond = text_encode(generator, 2)
        assert cond["hidden"].shape == (2, 512, 2560) and cond["mask"].shape == (2, 512)
        latents = torch.empty(2, *generator.latent_shape)
        assert generator.velocity(latents, torch.full((2,), 0.5), cond).shape == latents.shape
