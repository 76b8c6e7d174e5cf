"""FLUX.2 [klein] with a reference image against diffusers' own ``Flux2KleinPipeline`` on the tiny base folder.

The references are the pipeline's computation: its ``_encode_vae_image`` (VAE mode, 2x2 patchify, batch-norm
statistics) and ``prepare_image_latents`` (the reference's tokens and ids, time coordinate 10) for the velocity, its
sampling loop with ``image=`` (true CFG with the reference in both branches, Euler steps, the prediction of the
target tokens, decode) for whole samples, its scheduler's sigmas after a call with a reference, and its
``load_lora_weights``. Text-to-image klein is ``tests/test_flux2_klein.py``'s, unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.image_processor import VaeImageProcessor

from tests.helpers import built_generator, source_images, source_picture
from tests.pipelines import make_flux2_klein_pipeline, random_latents
from tests.test_flux2_klein import pipeline_velocity
from unirl_pl.generators import Flux2KleinGenerator, load_generator
from unirl_pl.loops import DiffusionDenoise, RolloutConfig

TOKENS = 32  # max_sequence_length: the chat template plus a short prompt fit
SIZE = {"height": 32, "width": 32}
TEXTS = ["make the cat red", "add a blue square"]
REFERENCE = (64, 64)  # the pipeline refuses a reference under 64 px a side


def _generator(folder: Path, **overrides: object) -> Flux2KleinGenerator:
    return built_generator(folder, Flux2KleinGenerator, TOKENS, {**SIZE, "source_size": REFERENCE}, **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_flux2_klein_pipeline(tmp_path_factory.mktemp("klein_base"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> Flux2KleinGenerator:
    return _generator(folder)


@pytest.fixture(scope="module")
def pipe(folder: Path) -> Flux2KleinPipeline:
    return Flux2KleinPipeline.from_pretrained(str(folder))


def _pipeline_velocity(
    pipe: Flux2KleinPipeline, latents: torch.Tensor, sigma: torch.Tensor, texts: list[str], sources: list[torch.Tensor]
) -> torch.Tensor:
    """The velocity as ``Flux2KleinPipeline.__call__`` computes it with ``image=`` for one step, one reference per
    sample: each picture through its ``image_processor.preprocess`` and ``prepare_image_latents``, the reference
    tokens and ids after the target's (:func:`tests.test_flux2_klein.pipeline_velocity`)."""
    with torch.no_grad():
        references = [
            pipe.prepare_image_latents(
                [pipe.image_processor.preprocess(source_picture(s), *s.shape[-2:], resize_mode="crop")],
                1,
                None,
                "cpu",
                torch.float32,
            )
            for s in sources
        ]
    reference = (torch.cat([r[0] for r in references]), torch.cat([r[1] for r in references]))
    return pipeline_velocity(pipe, latents, sigma, texts, reference)


def _cond(generator: Flux2KleinGenerator, texts: list[str], sources: list[torch.Tensor]) -> dict:
    return {**generator.encode(texts), **generator.encode_source(sources)}


# ------------------------------------------------------------------ reference latents and velocity
def test_velocity_with_a_reference_is_the_pipelines_transformer_call(
    generator: Flux2KleinGenerator, pipe: Flux2KleinPipeline
) -> None:
    assert generator.takes_source_images and generator.source_size == REFERENCE
    sources = source_images(2, REFERENCE)
    cond = _cond(generator, TEXTS, sources)
    assert cond["source_latents"].shape == (2, 16, 16, 16), "patchified, normalised: 4 x 4 channels, 64 px / 4"
    with torch.no_grad():
        pixels = torch.cat([pipe.image_processor.preprocess(source_picture(s), 64, 64) for s in sources])
        expected_latents = torch.cat([pipe._encode_vae_image(p[None], None) for p in pixels])
    torch.testing.assert_close(cond["source_latents"], expected_latents, rtol=0, atol=1e-6)
    latents, sigma = random_latents(generator.latent_shape, 2), torch.tensor([0.9, 0.3])
    expected = _pipeline_velocity(pipe, latents, sigma, TEXTS, sources)
    torch.testing.assert_close(generator.velocity(latents, sigma, cond), expected, rtol=0, atol=2e-6)


def test_a_sample_depends_on_its_own_reference_only(generator: Flux2KleinGenerator) -> None:
    sources = source_images(3, REFERENCE, seed=1)
    latents, sigma = random_latents(generator.latent_shape, 2, seed=2), torch.tensor([0.6, 0.6])
    with torch.no_grad():
        pair = generator.velocity(latents, sigma, _cond(generator, TEXTS, sources[:2]))
        alone = generator.velocity(latents[:1], sigma[:1], _cond(generator, TEXTS[:1], sources[:1]))
        other = generator.velocity(latents[:1], sigma[:1], _cond(generator, TEXTS[:1], sources[2:]))
        text_only = generator.velocity(latents[:1], sigma[:1], generator.encode(TEXTS[:1]))
    assert (pair[0] - alone[0]).abs().max() <= 1e-6, "a sample's velocity does not depend on its batch"
    assert (other[0] - alone[0]).abs().max() > 1e-4, "the reference image conditions the velocity"
    assert (text_only[0] - alone[0]).abs().max() > 1e-4


def test_a_reference_of_another_shape_keeps_its_aspect_ratio(
    generator: Flux2KleinGenerator, pipe: Flux2KleinPipeline
) -> None:
    """A 40 x 80 reference is resized to cover 64 x 64 keeping its aspect ratio and center-cropped (diffusers'
    ``VaeImageProcessor`` ``resize_mode="crop"``, Lanczos on the picture): the pipeline never stretches one."""
    source = source_images(1, (40, 80), seed=3)[0]
    pixels = VaeImageProcessor(vae_scale_factor=4).preprocess(source_picture(source), 64, 64, resize_mode="crop")
    with torch.no_grad():
        expected = pipe._encode_vae_image(pixels, None)
    torch.testing.assert_close(generator.encode_source([source])["source_latents"], expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ schedule and whole samples
@pytest.mark.parametrize("num_steps", [3, 5])
def test_schedule_with_a_reference_is_the_sigmas_of_a_real_pipeline_call(
    generator: Flux2KleinGenerator, pipe: Flux2KleinPipeline, num_steps: int
) -> None:
    """mu counts the target's tokens only: a 64 x 64 reference beside a 32 x 32 target leaves the schedule as is."""
    pipe(
        image=source_picture(source_images(1, REFERENCE)[0]),
        prompt="make it red",
        num_inference_steps=num_steps,
        guidance_scale=1.0,
        max_sequence_length=TOKENS,
        output_type="latent",
        **SIZE,
    )
    ours = generator.schedule(num_steps).sigmas
    torch.testing.assert_close(ours, pipe.scheduler.sigmas.to(torch.float64), rtol=0, atol=1e-7)


@pytest.mark.parametrize("target", [32, 64])
def test_guided_euler_steps_and_decode_reproduce_the_pipeline(folder: Path, pipe: Flux2KleinPipeline, target: int):
    """Two guided ODE steps (4.0, the empty prompt unconditional, as PromptRL samples klein-base) through the loop
    and ``decode`` equal ``pipe(image=..., ...)`` from the same noise: its latents after each step and its images.
    The pipeline's one reference conditions both prompts and both guidance branches; the loop fills the
    unconditional branch's reference from the conditional rows. At 64 px the reference has the target's size (the
    default ``source_size``)."""
    size = {"height": target, "width": target}
    source_size = None if target == 64 else REFERENCE  # 32 px: a 64 px reference beside the target
    generator = built_generator(folder, Flux2KleinGenerator, TOKENS, size, source_size=source_size)
    assert generator.source_size == REFERENCE
    source = source_images(1, REFERENCE, seed=4)[0]
    noise = random_latents(generator.latent_shape, 2, seed=5)
    steps: list[torch.Tensor] = []

    def capture(_pipe, _i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return {}

    images = pipe(
        image=source_picture(source),
        prompt=TEXTS,
        latents=noise.clone(),
        num_inference_steps=2,
        guidance_scale=4.0,
        max_sequence_length=TOKENS,
        output_type="pt",
        callback_on_step_end=capture,
        **size,
    ).images
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=2, guidance_scale=4.0))
    cond, uncond = _cond(generator, TEXTS, [source, source]), generator.encode([""])
    sigmas = loop.sigmas(2).float()
    x = noise.clone()
    with torch.no_grad():
        for i in range(2):
            x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, uncond)
            torch.testing.assert_close(Flux2KleinPipeline._pack_latents(x), steps[i], rtol=0, atol=1e-5)
    torch.testing.assert_close(generator.decode(x), images, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ LoRA
def test_exported_adapter_loads_into_the_pipeline_with_a_reference(folder: Path, tmp_path: Path) -> None:
    generator = _generator(folder)
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))
    sources = source_images(2, REFERENCE, seed=6)
    latents, sigma = random_latents(generator.latent_shape, 2, seed=7), torch.tensor([0.8, 0.4])
    cond = _cond(generator, TEXTS, sources)
    with torch.no_grad():
        trained = generator.velocity(latents, sigma, cond)
        with generator.adapter_disabled():
            reference = generator.velocity(latents, sigma, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = Flux2KleinPipeline.from_pretrained(str(folder))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS, sources), reference, rtol=0, atol=2e-6)
    pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS, sources), trained, rtol=0, atol=2e-6)
    assert isinstance(load_generator(folder), Flux2KleinGenerator)
