"""Qwen-Image-Edit-Plus (2509 / 2511) against diffusers' own ``QwenImageEditPlusPipeline`` on a tiny folder in the
published layout.

Every reference is the pipeline's computation: its ``_get_qwen_prompt_embeds`` / ``encode_prompt`` (through
transformers' own ``Qwen2VLProcessor.__call__``, see :func:`stand_in_processor`) for the text features, its
``image_processor``, ``prepare_latents`` (VAE encode, normalisation, packing), ``img_shapes`` and transformer call
for the velocity, a real ``pipe(...)`` call (true CFG with the negative prompt read with the image, the norm
rescale, Euler steps, decode) for whole samples and for the schedule, and its ``load_lora_weights`` for the adapter.

Scale: the tiny VAE downsamples 4x (the real one 8x) and the pipeline encodes its sources at a 1024x1024-pixel area
(16384 source tokens here, ~40 s a call on CPU), so the pipeline calls run with ``VAE_IMAGE_SIZE`` set to the tiny
32x32 target's area; the generator then encodes the source at 32x32 too (its default, the target's size).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import PIL.Image
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
from torch import Tensor
from transformers import Qwen2VLProcessor

from tests.helpers import built_generator
from tests.pipelines import QWENIMAGE_TEXT_WIDTH, random_latents
from tests.pipelines_qwen_edit import make_qwenimage_edit_plus_pipeline
from unirl_pl.generators import QwenImageEditPlusGenerator
from unirl_pl.generators.qwenimage_edit import EDIT_PROMPT_TEMPLATE, EDIT_TEMPLATE_TOKENS, to_pil
from unirl_pl.loops import DiffusionDenoise, RolloutConfig

TOKENS = 128  # max_sequence_length: 64 image tokens, the labels and the template's tail leave ~55 for the prompt
SIZE = {"height": 32, "width": 32}
TEXTS = ["make the cat red", "a big blue square on the left"]
LONG = " ".join(["a big red cat on the left of a small blue dog"] * 4)


def _image(height: int, width: int, seed: int) -> Tensor:
    """A (3, H, W) source in [0, 1] with 8-bit values, as the data layer reads a file."""
    return (torch.rand(3, height, width, generator=torch.Generator().manual_seed(seed)) * 255).round() / 255


SOURCES = [_image(32, 32, 1), _image(40, 56, 2), _image(48, 36, 3)]  # square, landscape, portrait


def stand_in_processor(generator: QwenImageEditPlusGenerator) -> Qwen2VLProcessor:
    """transformers' own ``Qwen2VLProcessor`` around the folder's processor tokenizer and image processor. Its
    ``__init__`` checks each part's class through the video-processor registry, which fails without torchvision
    (FINDINGS), so the object is made without it and given the attributes ``__init__`` sets; ``__call__`` (the image
    processor, the pad expansion, the tokenizer) is then the library's own code, not ours."""
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    tokenizer = generator.tokenizer
    processor.tokenizer, processor.image_processor, processor.chat_template = tokenizer, generator.image_processor, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


def _pipe(folder: Path, generator: QwenImageEditPlusGenerator) -> QwenImageEditPlusPipeline:
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(folder), processor=None)
    pipe.processor = stand_in_processor(generator)
    return pipe


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwenimage_edit_plus_pipeline(tmp_path_factory.mktemp("qwenimage_edit"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> QwenImageEditPlusGenerator:
    return built_generator(folder, QwenImageEditPlusGenerator, TOKENS, SIZE)


@pytest.fixture(scope="module")
def pipe(folder: Path, generator: QwenImageEditPlusGenerator) -> QwenImageEditPlusPipeline:
    return _pipe(folder, generator)


@pytest.fixture
def tiny_vae_area(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's source VAE area at the tiny target's 32x32 (see the module docstring)."""
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 32 * 32)


def _cond(generator: QwenImageEditPlusGenerator, texts: list[str], images: list[Tensor]) -> dict[str, Tensor]:
    """What the trainer conditions on: the text features read with the images, merged with the source's."""
    return {**generator.encode(texts, images), **generator.encode_source(images)}


def _condition_image(pipe: QwenImageEditPlusPipeline, image: Tensor) -> PIL.Image.Image:
    """The text encoder's image as ``QwenImageEditPlusPipeline.__call__`` makes it (its step 3)."""
    pil = to_pil(image)
    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, pil.width / pil.height)
    return pipe.image_processor.resize(pil, height, width)


def _pipeline_velocity(
    pipe: QwenImageEditPlusPipeline,
    latents: Tensor,
    sigma: Tensor,
    text: str,
    image: Tensor,
    source_size: tuple[int, int] = (32, 32),
) -> Tensor:
    """One sample's velocity as ``QwenImageEditPlusPipeline.__call__`` computes it for one step: ``encode_prompt``
    with the condition image, ``image_processor.preprocess`` of the source at the generator's ``source_size`` (by
    default the target's 32x32), ``prepare_latents`` with it (VAE mode, normalisation, packing), the ``img_shapes``
    of the target and the source, ``timestep / 1000`` of the scheduler's ``sigma * 1000``, the prediction cut to the
    target."""
    _, channels, height, width = latents.shape
    factor = pipe.vae_scale_factor
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompt=[text], image=[_condition_image(pipe, image)])
        vae_image = pipe.image_processor.preprocess(to_pil(image), *source_size).unsqueeze(2)
        packed = pipe._pack_latents(latents, 1, channels, height, width)
        packed, image_latents = pipe.prepare_latents(
            [vae_image], 1, channels, height * factor, width * factor, torch.float32, "cpu", None, latents=packed
        )
        rows, columns = (side // factor // 2 for side in source_size)
        img_shapes = [[(1, height // 2, width // 2), (1, rows, columns)]]
        out = pipe.transformer(
            hidden_states=torch.cat([packed, image_latents], dim=1),
            timestep=(sigma * 1000).to(torch.float32) / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=img_shapes,
            return_dict=False,
        )[0][:, : packed.shape[1]]
    return pipe._unpack_latents(out, height * factor, width * factor, factor)[:, :, 0]


# ------------------------------------------------------------------ the folder
def test_fixture_is_the_published_layout(folder: Path, generator: QwenImageEditPlusGenerator) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for part in ("scheduler", "text_encoder", "tokenizer", "processor", "transformer", "vae"):
        assert (folder / part).is_dir(), part
    settings = json.loads((folder / "processor" / "preprocessor_config.json").read_text())
    assert settings["image_processor_type"] == "Qwen2VLImageProcessor" and settings["merge_size"] == 2
    # The template's system turn and user header are the 64 tokens the pipeline drops, as in Qwen2.5-VL's BPE.
    prefix = EDIT_PROMPT_TEMPLATE.split("{}")[0]
    assert EDIT_TEMPLATE_TOKENS == 64 and len(generator.tokenizer(prefix).input_ids) == 64
    assert generator.latent_shape == (4, 8, 8) and generator.source_latent_size == (8, 8)
    assert generator.img_shapes(2) == [[(1, 4, 4), (1, 4, 4)]] * 2
    with pytest.raises(ValueError, match=r"source_size height \(30\) must be a multiple of 8"):
        QwenImageEditPlusGenerator(str(folder), source_size=(30, 32), **SIZE).latent_shape  # noqa: B018
    assert QwenImageEditPlusGenerator(str(folder), source_size=[64, 32], **SIZE).source_latent_size == (16, 8)


# ------------------------------------------------------------------ conditioning
def test_features_are_the_pipelines_prompt_embeds_with_the_image(
    generator: QwenImageEditPlusGenerator, pipe: QwenImageEditPlusPipeline
) -> None:
    images = SOURCES[:2]
    cond = _cond(generator, TEXTS, images)
    assert set(cond) == {"hidden", "mask", "empty_prompt", "source_latents", "source_negative_hidden",
                         "source_negative_mask"}  # fmt: skip
    assert cond["hidden"].shape == (2, TOKENS, QWENIMAGE_TEXT_WIDTH) and cond["mask"].shape == (2, TOKENS)
    assert cond["empty_prompt"].tolist() == [[0.0], [0.0]]
    for i, (text, image) in enumerate(zip(TEXTS, images, strict=True)):
        for prompt, hidden, mask in [
            (text, cond["hidden"][i], cond["mask"][i]),
            ("", cond["source_negative_hidden"][i], cond["source_negative_mask"][i]),  # the pipeline's negative
        ]:
            with torch.no_grad():
                expected, expected_mask = pipe._get_qwen_prompt_embeds([prompt], [_condition_image(pipe, image)])
            length = expected.shape[1]
            assert expected_mask.tolist() == [[1] * length] and 40 < length < TOKENS, length
            torch.testing.assert_close(hidden[:length], expected[0], rtol=0, atol=0)
            assert mask.tolist() == [1.0] * length + [0.0] * (TOKENS - length) and not hidden[length:].any()
    # Without an image (the loop's unconditional row): the pipeline's prompt embeds of the text alone, marked.
    alone = generator.encode(["", TEXTS[0]])
    assert alone["empty_prompt"].tolist() == [[1.0], [0.0]]
    for i, text in enumerate(["", TEXTS[0]]):
        with torch.no_grad():
            expected, _ = pipe._get_qwen_prompt_embeds([text], None)
        torch.testing.assert_close(alone["hidden"][i, : expected.shape[1]], expected[0], rtol=0, atol=0)
    # The image is read: a second source changes the features.
    assert (generator.encode([TEXTS[0]], [SOURCES[1]])["hidden"] - cond["hidden"][:1]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["2509", "2511", "2509, a 48x64 source"])
def test_velocity_is_the_pipelines_transformer_call(
    variant: str, folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Ours for a batch of two samples against the pipeline's call for each alone; 2511's transformer
    (``zero_cond_t``: the source tokens modulated at timestep 0) as well, and a source larger than the target (more
    source tokens, the text's RoPE table starting after the larger grid)."""
    if variant == "2511":
        folder = make_qwenimage_edit_plus_pipeline(tmp_path_factory.mktemp("qwenimage_edit_2511"), zero_cond_t=True)
    source_size = (48, 64) if "48x64" in variant else (32, 32)
    generator = built_generator(folder, QwenImageEditPlusGenerator, TOKENS, SIZE, source_size=source_size)
    assert generator.model.config.zero_cond_t == (variant == "2511")
    pipe = _pipe(folder, generator)
    latents, sigma = random_latents(generator.latent_shape, 2), torch.tensor([0.9, 0.3])
    images = [SOURCES[0], SOURCES[2]]
    cond = _cond(generator, TEXTS, images)
    ours = generator.velocity(latents, sigma, cond)
    for i in range(2):
        expected = _pipeline_velocity(pipe, latents[i : i + 1], sigma[i : i + 1], TEXTS[i], images[i], source_size)
        gap = (ours[i : i + 1] - expected).abs().max().item()
        print(f"{variant} sample {i}: ours vs the pipeline's transformer call {gap:.2e}")
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ whole samples and the schedule
def test_sampling_with_true_cfg_reproduces_the_pipeline(
    generator: QwenImageEditPlusGenerator, pipe: QwenImageEditPlusPipeline, folder: Path, tiny_vae_area: None
) -> None:
    """Three guided ODE steps through the loop (true CFG 4.0, the empty prompt as the negative, its features read
    with the source as the pipeline reads them) and ``decode`` equal ``pipe(image, prompt, negative_prompt="")`` from
    the same noise, after every step; with the negative's image left out the same comparison fails."""
    noise, image = random_latents(generator.latent_shape, 1, seed=3), SOURCES[0]
    steps: list[Tensor] = []

    def capture(_pipe: Any, _i: int, _t: Any, kwargs: dict) -> dict:
        steps.append(kwargs["latents"].clone())
        return {}

    images = pipe(
        image=to_pil(image),
        prompt=TEXTS[0],
        negative_prompt="",
        true_cfg_scale=4.0,
        latents=pipe._pack_latents(noise.clone(), 1, 4, 8, 8),
        num_inference_steps=3,
        output_type="pt",
        callback_on_step_end=capture,
        **SIZE,
    ).images

    def sample(gen: QwenImageEditPlusGenerator) -> list[Tensor]:
        loop = DiffusionDenoise(gen, RolloutConfig(num_steps=3, guidance_scale=4.0))
        cond, uncond = _cond(gen, TEXTS[:1], [image]), gen.encode([""])
        sigmas, x, out = loop.sigmas(3).float(), noise.clone(), []
        with torch.no_grad():
            for i in range(3):
                x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, uncond)
                out.append(x)
        return out

    ours = sample(generator)
    for i, x in enumerate(ours):
        torch.testing.assert_close(pipe._pack_latents(x, 1, 4, 8, 8), steps[i], rtol=0, atol=1e-6)
    gap = (generator.decode(ours[-1]) - images).abs().max().item()
    print(f"pixels vs pipe(...): {gap:.2e}")
    assert gap <= 1e-6
    blind = built_generator(folder, QwenImageEditPlusGenerator, TOKENS, SIZE, negative_sees_source=False)
    twin = (pipe._pack_latents(sample(blind)[-1], 1, 4, 8, 8) - steps[-1]).abs().max().item()
    print(f"twin (negative without the image): latents off by {twin:.2e}")
    assert twin > 1e-3


def _spied_call(pipe: QwenImageEditPlusPipeline, monkeypatch: pytest.MonkeyPatch, steps: int) -> dict:
    """A real ``pipe(...)`` call; the ``sigmas`` and ``mu`` its ``set_timesteps`` received and the sigmas it left."""
    seen: dict = {}
    original = type(pipe.scheduler).set_timesteps

    @functools.wraps(original)  # the pipeline inspects its signature for ``sigmas``
    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        seen.update(mu=kw.get("mu"))
        return original(self, *args, **kw)

    monkeypatch.setattr(type(pipe.scheduler), "set_timesteps", spy)
    pipe(
        image=to_pil(SOURCES[0]),
        prompt=TEXTS[0],
        num_inference_steps=steps,
        output_type="latent",
        true_cfg_scale=1.0,
        **SIZE,
    )
    seen["sigmas"] = pipe.scheduler.sigmas.to(torch.float64)
    return seen


@pytest.mark.parametrize("steps", [4, 7])
def test_schedule_is_the_sigmas_and_mu_of_a_real_pipeline_call(
    generator: QwenImageEditPlusGenerator,
    pipe: QwenImageEditPlusPipeline,
    steps: int,
    monkeypatch: pytest.MonkeyPatch,
    tiny_vae_area: None,
) -> None:
    """``mu`` comes from the target's token count alone (the source tokens do not count), as in the pipeline."""
    seen = _spied_call(pipe, monkeypatch, steps)
    schedule = generator.schedule(steps)
    torch.testing.assert_close(schedule.sigmas, seen["sigmas"], rtol=0, atol=1e-7)
    assert schedule.details["mu"] == seen["mu"] and schedule.sigmas.shape == (steps + 1,)


# ------------------------------------------------------------------ the source matters, and only a sample's own
def test_output_changes_with_the_source_image(generator: QwenImageEditPlusGenerator) -> None:
    latents, sigma = random_latents(generator.latent_shape, 1, seed=5), torch.tensor([0.6])
    first, second = (_cond(generator, TEXTS[:1], [image]) for image in SOURCES[:2])
    base = generator.velocity(latents, sigma, first)
    # Each route of the image alone moves the prediction: the text encoder's view and the source latents.
    for keys in (("hidden", "mask"), ("source_latents",)):
        mixed = {**first, **{key: second[key] for key in keys}}
        gap = (generator.velocity(latents, sigma, mixed) - base).abs().max().item()
        print(f"source swapped in {keys}: velocity moves {gap:.2e}")
        assert gap > 1e-4, "float rounding is ~1e-7: the image moved the prediction"


def test_a_samples_result_does_not_depend_on_the_other_sources_of_its_batch(
    generator: QwenImageEditPlusGenerator,
) -> None:
    """Three guided ODE steps of a sample alone and batched with a much longer prompt and a source of another
    size and aspect (the text widths, image-token counts and negatives differ): the same latents."""
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=3, guidance_scale=4.0))
    uncond = generator.encode([""])
    alone, _ = loop.sample(_cond(generator, TEXTS[:1], SOURCES[:1]), [7], [0], "serve", seed=3, uncond=uncond)
    cond = _cond(generator, [TEXTS[0], LONG], [SOURCES[0], SOURCES[1]])
    assert cond["mask"][1].sum() > cond["mask"][0].sum() + 30
    batched, _ = loop.sample(cond, [7, 8], [0, 0], "serve", seed=3, uncond=uncond)
    gap = (batched[:1] - alone).abs().max().item()
    print(f"alone vs batched: {gap:.2e}")
    assert gap <= 1e-6


def test_missing_source_latents_are_refused(generator: QwenImageEditPlusGenerator) -> None:
    latents = random_latents(generator.latent_shape, 1)
    with pytest.raises(ValueError, match="source latents"):
        generator.velocity(latents, torch.tensor([0.5]), generator.encode([TEXTS[0]], SOURCES[:1]))


# ------------------------------------------------------------------ LoRA
def test_adapter_export_loads_through_the_pipeline(folder: Path, tmp_path: Path) -> None:
    generator = built_generator(folder, QwenImageEditPlusGenerator, TOKENS, SIZE)
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))
    latents, sigma = random_latents(generator.latent_shape, 1), torch.tensor([0.7])
    cond = _cond(generator, TEXTS[:1], SOURCES[2:])
    trained = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        assert (generator.velocity(latents, sigma, cond) - trained).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = _pipe(folder, generator)
    pipe.load_lora_weights(str(tmp_path))
    expected = _pipeline_velocity(pipe, latents, sigma, TEXTS[0], SOURCES[2])
    torch.testing.assert_close(trained, expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the memory plan
def test_plan_traces_the_text_encoder_reading_the_source_and_the_source_tokens(
    folder: Path, generator: QwenImageEditPlusGenerator
) -> None:
    """``python -m unirl_pl plan``'s trace of this family on fake tensors (built from the folder's configs: no pixels,
    no tokenizer, no PIL): the text encoder gets what the image processor makes of a real source of that size (the
    same patches, grid and count of image pads as :meth:`text_inputs` of a real image), its real Qwen2.5-VL forward
    runs with the image tokens (transformers checks their count against the features from the carried values), so
    the text-encode phase (prompt and negative read with the source, the source's VAE encode) is larger than the
    text alone; and each DiT forward carries the source's tokens after the target's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.plan import phases
    from unirl_pl.plan.models import build_generator
    from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker

    mode = FakeTensorMode()
    fake, _ = build_generator(
        QwenImageEditPlusGenerator, {"max_sequence_length": TOKENS, "dtype": "float32", **SIZE}, folder, mode
    )
    pad = generator.text_encoder.config.image_token_id

    def processed(inputs: dict[str, Tensor]) -> tuple[tuple[int, ...], list[list[int]], int]:
        """The patches' shape, the grid and the count of image pads."""
        pads = int((inputs["input_ids"] == pad).sum())
        return tuple(inputs["pixel_values"].shape), inputs["image_grid_thw"].tolist(), pads

    reals = [processed(generator.text_inputs(TEXTS[0], image)) for image in SOURCES]  # square, landscape, portrait
    assert all(count > 0 for *_, count in reals) and len(set(map(str, reals))) == 3
    peaks = {}
    with mode, AllRowsReal() as rows:
        for image, real in zip(SOURCES, reals, strict=True):
            with rows.carrying_values():
                shaped = fake.text_inputs(TEXTS[0], torch.empty(image.shape))
                assert processed(shaped) == real
                # The longest prompt whose features are kept: the template's dropped tokens and the feature width.
                assert shaped["input_ids"].shape == (1, EDIT_TEMPLATE_TOKENS + TOKENS)
        for sources in (False, True):
            tracker = PlanMemTracker()
            tracker.track_external(fake)
            with tracker:
                cond = phases.text_encode(fake, 2, sources)
            peaks[sources] = tracker.peak()
        assert cond["hidden"].shape == cond["source_negative_hidden"].shape == (2, TOKENS, QWENIMAGE_TEXT_WIDTH)
        assert cond["source_latents"].shape == (2, 16, 16)  # 32x32 source: 8x8 latents, 4x4 packed tokens
        assert peaks[True].activations > peaks[False].activations
        seen: list[tuple[int, ...]] = []
        fake.model.register_forward_pre_hook(
            lambda _module, _args, kwargs: seen.append(tuple(kwargs["hidden_states"].shape)), with_kwargs=True
        )
        loop = DiffusionDenoise(fake, RolloutConfig(num_steps=4, guidance_scale=4.0))
        uncond = {key: value[-1:] for key, value in cond.items()}
        phases.dit_rollout_step(loop, cond, uncond)
    assert seen == [(4, 16 + 16, 16)]  # guided: 2 x 2 rows; the target's 16 tokens, then the source's 16
    print(f"text_encode activations: {peaks[True].activations} B with the source, {peaks[False].activations} without")
