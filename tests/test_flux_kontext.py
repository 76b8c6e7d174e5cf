"""FLUX.1 Kontext [dev] against diffusers' own ``FluxKontextPipeline`` on a tiny folder.

Every reference is the pipeline's computation, not a formula of ours: its ``image_processor``, ``prepare_latents``
(VAE mode, shift and scale, packing, the source ids' first coordinate 1), ``encode_prompt`` and transformer call
for the velocity; its sampling loop (schedule with ``mu`` of the target, Euler steps, slicing the source tokens
off, decode) for whole samples; its scheduler's sigmas after a real call; its ``load_lora_weights`` for the
exported adapter. The plan's trace must see the source tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxKontextPipeline

from tests.helpers import ROOT, built_generator, source_images, source_picture
from tests.pipelines import make_flux_pipeline, random_latents
from tests.pipelines_edit import make_flux_kontext_pipeline
from unirl_pl.generators import FluxGenerator, FluxKontextGenerator, load_generator
from unirl_pl.loops import DiffusionDenoise, RolloutConfig

TOKENS = 16  # T5 max_sequence_length
SIZE = {"height": 32, "width": 32}
SIZE_PX = (32, 32)  # the sources' size where a test names none
TEXTS = ["make the cat red", "add a blue square"]
GUIDANCE = 2.5  # the Kontext model card's and PromptRL's edit guidance (the generator's default)


def _generator(folder: Path, **overrides: object) -> FluxKontextGenerator:
    return built_generator(folder, FluxKontextGenerator, TOKENS, SIZE, **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_flux_kontext_pipeline(tmp_path_factory.mktemp("kontext"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> FluxKontextGenerator:
    return _generator(folder)


@pytest.fixture(scope="module")
def pipe(folder: Path) -> FluxKontextPipeline:
    return FluxKontextPipeline.from_pretrained(str(folder))


def _pipeline_velocity(
    pipe: FluxKontextPipeline,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    texts: list[str],
    pixels: torch.Tensor | None,
) -> torch.Tensor:
    """The velocity as ``FluxKontextPipeline.__call__`` computes it for one step: ``pixels`` (B, 3, h, w) in [0, 1]
    through its ``image_processor.preprocess`` and ``prepare_latents`` (the source latents and ids), its prompt
    embeddings, the source tokens after the target's, ``t / 1000`` of the scheduler's ``sigma * 1000``, its
    guidance tensor, the prediction of the target tokens unpacked."""
    batch, channels, height, width = latents.shape
    factor = pipe.vae_scale_factor
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(texts, None, max_sequence_length=TOKENS)
        image = None if pixels is None else pipe.image_processor.preprocess(pixels, *pixels.shape[-2:])
        packed = pipe._pack_latents(latents, batch, channels, height, width)
        packed, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            image, batch, channels, height * factor, width * factor, torch.float32, "cpu", None, packed
        )
        if image_latents is not None:
            packed, latent_ids = torch.cat([packed, image_latents], dim=1), torch.cat([latent_ids, image_ids])
        timestep = (sigma * 1000).to(torch.float32)
        out = pipe.transformer(
            hidden_states=packed,
            timestep=timestep / 1000,
            guidance=torch.full([1], GUIDANCE, dtype=torch.float32).expand(batch),
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=latent_ids,
            return_dict=False,
        )[0][:, : (height // 2) * (width // 2)]
    return pipe._unpack_latents(out, height * factor, width * factor, factor)


def _cond(generator: FluxKontextGenerator, texts: list[str], sources: list[torch.Tensor]) -> dict:
    return {**generator.encode(texts), **generator.encode_source(sources)}


def _perturb_lora(generator: FluxKontextGenerator) -> None:
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


# ------------------------------------------------------------------ source latents and velocity
def test_velocity_is_the_pipelines_transformer_call(generator: FluxKontextGenerator, pipe: FluxKontextPipeline) -> None:
    assert load_generator(generator.pipeline_path).__class__ is FluxKontextGenerator
    assert generator.takes_source_images and generator.guidance_scale == GUIDANCE
    assert generator.latent_shape == (4, 16, 16) and generator.source_size == (32, 32)
    sources = source_images(2, SIZE_PX)
    cond = _cond(generator, TEXTS, sources)
    assert cond["source_latents"].shape == (2, *generator.latent_shape), "unpacked, the target's latent space"
    with torch.no_grad():
        pixels = pipe.image_processor.preprocess(torch.stack(sources))
        expected_latents = torch.cat([pipe._encode_vae_image(p[None], None) for p in pixels])
    torch.testing.assert_close(cond["source_latents"], expected_latents, rtol=0, atol=1e-6)

    latents, sigma = random_latents(generator.latent_shape, 2), torch.tensor([0.9, 0.3])
    expected = _pipeline_velocity(pipe, latents, sigma, TEXTS, torch.stack(sources))
    torch.testing.assert_close(generator.velocity(latents, sigma, cond), expected, rtol=0, atol=2e-6)
    # Without source latents it is the pipeline's text-to-image call (image=None).
    text_only = generator.encode(TEXTS)
    expected = _pipeline_velocity(pipe, latents, sigma, TEXTS, None)
    torch.testing.assert_close(generator.velocity(latents, sigma, text_only), expected, rtol=0, atol=2e-6)


def test_a_sample_depends_on_its_own_source_only(generator: FluxKontextGenerator) -> None:
    sources = source_images(3, SIZE_PX, seed=1)
    latents, sigma = random_latents(generator.latent_shape, 2, seed=2), torch.tensor([0.7, 0.7])
    with torch.no_grad():
        pair = generator.velocity(latents, sigma, _cond(generator, TEXTS, sources[:2]))
        alone = generator.velocity(latents[:1], sigma[:1], _cond(generator, TEXTS[:1], sources[:1]))
        other = generator.velocity(latents[:1], sigma[:1], _cond(generator, TEXTS[:1], sources[2:]))
    assert (pair[0] - alone[0]).abs().max() <= 1e-6, "a sample's velocity does not depend on its batch"
    assert (other[0] - alone[0]).abs().max() > 1e-3, "the source image conditions the velocity"


def test_a_source_of_another_size_is_resized_as_the_pipeline_resizes_a_picture(
    generator: FluxKontextGenerator, pipe: FluxKontextPipeline
) -> None:
    """A 40 x 48 source becomes a 32 x 32 one through the pipeline's own ``image_processor`` (Lanczos on the
    picture, stretched as Kontext's pipeline resizes), then its VAE encode."""
    source = source_images(1, (40, 48), seed=3)[0]
    with torch.no_grad():
        resized = pipe.image_processor.resize(source_picture(source), 32, 32)
        expected = pipe._encode_vae_image(pipe.image_processor.preprocess(resized, 32, 32), None)
    torch.testing.assert_close(generator.encode_source([source])["source_latents"], expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ schedule and whole samples
@pytest.mark.parametrize("num_steps", [3, 7])
def test_schedule_is_the_sigmas_of_a_real_pipeline_call(folder: Path, pipe: FluxKontextPipeline, num_steps: int):
    """mu comes from the target's token count: a 64 x 64 source does not move the schedule."""
    schedules = []
    for height, width in [(32, 32), (64, 32)]:
        pipe(
            image=source_picture(source_images(1, (64, 64))[0]),
            prompt="make it red",
            height=height,
            width=width,
            max_area=height * width,
            _auto_resize=False,
            num_inference_steps=num_steps,
            max_sequence_length=TOKENS,
            output_type="latent",
        )
        ours = load_generator(folder, height=height, width=width).schedule(num_steps).sigmas
        assert ours.shape == (num_steps + 1,) and ours[0] == 1.0 and ours[-1] == 0.0
        torch.testing.assert_close(ours, pipe.scheduler.sigmas.to(torch.float64), rtol=0, atol=1e-7)
        schedules.append(ours)
    assert (schedules[1][1:-1] > schedules[0][1:-1]).all(), "mu grows with the target's tokens"


@pytest.mark.parametrize("source_size", [None, (48, 48)])
def test_euler_steps_and_decode_reproduce_the_pipeline(
    folder: Path, generator: FluxKontextGenerator, pipe: FluxKontextPipeline, source_size: tuple[int, int] | None
) -> None:
    """Two ODE steps of our velocity on our schedule and ``decode`` equal ``pipe(image=..., ...)`` from the same
    noise: its latents after each step and its images. With ``source_size`` 48 x 48 the pipeline is given 48 x 48
    pictures (``_auto_resize=False`` keeps a source's own size): 144 source tokens beside 64 target tokens."""
    if source_size is not None:
        generator = _generator(folder, source_size=source_size)
    sources = source_images(2, source_size or SIZE_PX, seed=4)
    noise = random_latents(generator.latent_shape, 2, seed=5)
    steps: list[torch.Tensor] = []

    def capture(_pipe, _i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return {}

    images = pipe(
        image=[source_picture(s) for s in sources] if source_size else torch.stack(sources),
        prompt=TEXTS,
        latents=pipe._pack_latents(noise, 2, 4, 16, 16),
        max_area=32 * 32,
        _auto_resize=False,
        num_inference_steps=2,
        guidance_scale=GUIDANCE,
        max_sequence_length=TOKENS,
        output_type="pt",
        callback_on_step_end=capture,
        **SIZE,
    ).images
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=2))
    cond = _cond(generator, TEXTS, sources)
    sigmas = loop.sigmas(2).float()
    x = noise.clone()
    with torch.no_grad():
        for i in range(2):
            x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, None)
            torch.testing.assert_close(pipe._pack_latents(x, 2, 4, 16, 16), steps[i], rtol=0, atol=1e-5)
    torch.testing.assert_close(generator.decode(x), images, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ LoRA and refusals
def test_exported_adapter_loads_into_the_kontext_pipeline(folder: Path, tmp_path: Path) -> None:
    generator = _generator(folder)
    _perturb_lora(generator)
    sources = source_images(2, SIZE_PX, seed=6)
    latents, sigma = random_latents(generator.latent_shape, 2, seed=7), torch.tensor([0.8, 0.4])
    cond = _cond(generator, TEXTS, sources)
    with torch.no_grad():
        trained = generator.velocity(latents, sigma, cond)
        with generator.adapter_disabled():
            reference = generator.velocity(latents, sigma, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = FluxKontextPipeline.from_pretrained(str(folder))
    pixels = torch.stack(sources)
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS, pixels), reference, rtol=0, atol=2e-6)
    pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS, pixels), trained, rtol=0, atol=2e-6)


def test_text_only_family_refuses_source_images_and_bad_source_sizes_are_named(folder: Path, tmp_path: Path) -> None:
    flux = built_generator(make_flux_pipeline(tmp_path / "flux"), FluxGenerator, TOKENS, SIZE)
    with pytest.raises(ValueError, match=r"FluxGenerator \(flux\) generates from text alone"):
        flux.encode_source(source_images(1, SIZE_PX))
    with pytest.raises(ValueError, match=r"source_size height \(30\) must be a multiple of 4 pixels"):
        FluxKontextGenerator(str(folder), source_size=(30, 32), **SIZE).latent_shape  # noqa: B018
    with pytest.raises(ValueError, match="source_width must be > 0"):
        FluxKontextGenerator(str(folder), source_size=(32, 0), **SIZE)


# ------------------------------------------------------------------ plan
def test_plan_traces_the_source_tokens(folder: Path) -> None:
    """The plan's conditioning (``phases.text_encode``, which sizes the step's stacked ``cond`` and the rollout's
    and update's inputs) carries the source latents, so its DiT forward sees the target's and the source's tokens:
    more activation bytes than the same step on text alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.plan import phases
    from unirl_pl.plan.models import build_generator
    from unirl_pl.plan.tracker import PlanMemTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    init = {"height": 64, "width": 64, "max_sequence_length": TOKENS, "dtype": "float32"}
    fake, _ = build_generator(FluxKontextGenerator, init, folder, mode)
    loop = DiffusionDenoise(fake, RolloutConfig(num_steps=2))
    peaks = {}
    with mode:
        cond = phases.text_encode(fake, 2, sources=True)
        assert cond["source_latents"].shape == (2, *fake.latent_shape)
        for name, rows in (("edit", cond), ("text", {k: v for k, v in cond.items() if k != "source_latents"})):
            tracker = PlanMemTracker()
            tracker.track_external(fake)
            with tracker:
                phases.dit_rollout_step(loop, rows, None)
            peaks[name] = tracker.peak().activations
    assert peaks["edit"] > 1.5 * peaks["text"], peaks


def test_a_plan_counts_source_images_when_the_step_edits(tmp_path: Path) -> None:
    """A recipe edits when its generator takes source images and its prompt file's rows name them; a prompt file
    that is not on this machine counts as editing for an editing model (Kontext), not for klein, which also
    generates from text alone (the PromptRL klein recipe's GenEval file lives on the training machine)."""
    from unirl_pl.generators import Flux2KleinGenerator
    from unirl_pl.plan.recipe import recipe_edits

    edits, text = tmp_path / "edits.jsonl", tmp_path / "text.jsonl"
    edits.write_text('{"prompt": "make it red", "image": "cat.png"}\n')
    text.write_text('{"prompt": "a red cat", "tag": "colors"}\n')
    missing = str(tmp_path / "elsewhere.jsonl")
    assert recipe_edits(FluxKontextGenerator, str(edits)) and recipe_edits(Flux2KleinGenerator, str(edits))
    assert not recipe_edits(FluxKontextGenerator, str(text)) and not recipe_edits(Flux2KleinGenerator, str(text))
    assert recipe_edits(FluxKontextGenerator, missing) and not recipe_edits(Flux2KleinGenerator, missing)
    assert not recipe_edits(FluxGenerator, str(edits)) and not recipe_edits(FluxKontextGenerator, ["make it red"])


@pytest.mark.slow
def test_plan_of_a_kontext_recipe_counts_the_source_tokens(folder: Path, tmp_path: Path) -> None:
    """``plan_step`` of ``recipes/flux.yaml`` with the Kontext generator on the tiny folder: with an editing prompt
    file every DiT phase holds more activations than the same recipe on text prompts, and the plan says why."""
    from tests.chat_lm import make_qwen2_chat_lm
    from tests.test_plan import TINY
    from unirl_pl.plan.planner import plan_step
    from unirl_pl.plan.recipe import parsed_recipe, step_recipe

    lm = make_qwen2_chat_lm(tmp_path / "qwen")
    (tmp_path / "edits.jsonl").write_text('{"prompt": "make it red", "image": "cat.png"}\n')
    (tmp_path / "text.txt").write_text("a red cat\n")
    # The tiny recipe of the plan tests (float32, 32 px, 16 text tokens, 2 x 2 samples) with the Kontext generator.
    tiny = {
        **TINY,
        "model.generator.class_path": "unirl_pl.generators.FluxKontextGenerator",
        "model.generator.init_args.guidance_scale": "2.5",
    }
    plans = {}
    for name in ("edits.jsonl", "text.txt"):
        args = [f"--{k}={v}" for k, v in {**tiny, "data.prompts": str(tmp_path / name)}.items()]
        recipe = step_recipe(parsed_recipe(["--config", str(ROOT / "recipes" / "flux.yaml"), *args]))
        assert recipe.edits == (name == "edits.jsonl")
        plans[name] = plan_step(
            recipe, budget=1 << 40, title=name, pipeline_path=str(folder), llm_path=lm, prompt_tokens=24,
            log=lambda _: None, search=False,
        )  # fmt: skip
    edit, text = (plans[n].recipe_candidate.phases for n in ("edits.jsonl", "text.txt"))
    for phase in ("dit_rollout", "dit_update"):
        assert edit[phase].activations > 1.3 * text[phase].activations, (phase, edit[phase], text[phase])
    assert any("source image (32 x 32 px)" in note for note in plans["edits.jsonl"].notes)
