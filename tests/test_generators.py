"""The family generators (SD3, FLUX, Wan) on tiny random diffusers pipeline folders: loading, the
conditioning and velocity conventions, batch independence, decoding, LoRA and the adapter export that
the family's own diffusers pipeline reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from tests.pipelines import (
    CLIP_LENGTH,
    IMAGE_SIZE,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    make_flux_pipeline,
    make_sd3_pipeline,
    make_wan_pipeline,
    random_latents,
)
from unirl_pl.generators import FlowGenerator, FluxGenerator, SD3Generator, WanGenerator, load_generator

TOKENS = 16  # max_sequence_length of the T5-style encoders in these tests
# Per family: builder, class, size arguments, latent shape, Cond key -> per-sample shape.
FAMILIES = {
    "sd3": (
        make_sd3_pipeline,
        SD3Generator,
        {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        (4, 16, 16),
        {"hidden": (CLIP_LENGTH + TOKENS, 32), "pooled": (8 + 16,)},
    ),
    "flux": (
        make_flux_pipeline,
        FluxGenerator,
        {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        (4, 16, 16),
        {"hidden": (TOKENS, 32), "pooled": (16,)},
    ),
    "wan": (
        make_wan_pipeline,
        WanGenerator,
        {"height": VIDEO_SIZE, "width": VIDEO_SIZE, "num_frames": VIDEO_FRAMES},
        (4, 3, 4, 4),
        {"hidden": (TOKENS, 32)},
    ),
}
TEXTS = ["a red  cat on the left", "b", "two big blue squares"]


def _make(path: Path, family: str, **overrides: object) -> FlowGenerator:
    _, _, sizes, _, _ = FAMILIES[family]
    kwargs = {"dtype": "float32", "lora_rank": 4, "lora_alpha": 8.0, "max_sequence_length": TOKENS, **sizes}
    generator = load_generator(path, **{**kwargs, **overrides})
    generator.build()
    return generator


def _perturb_lora(generator: FlowGenerator, seed: int = 0) -> None:
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


def _inputs(generator: FlowGenerator, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor, dict]:
    texts = (TEXTS * batch)[:batch]
    sigma = torch.linspace(0.1, 0.9, batch)
    return random_latents(generator.latent_shape, batch), sigma, generator.encode(texts)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def pipeline_path(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[family][0](tmp_path_factory.mktemp(f"{family}_pipeline"))


@pytest.fixture(scope="module")
def generator(family: str, pipeline_path: Path) -> FlowGenerator:
    """A built float32 generator shared by the tests that do not change it."""
    return _make(pipeline_path, family)


def test_load_picks_class_and_latent_shape(family: str, pipeline_path: Path) -> None:
    _, cls, sizes, latent_shape, _ = FAMILIES[family]
    generator = load_generator(pipeline_path, dtype="float32", **sizes)
    assert type(generator) is cls and generator.family == family and not generator.is_built
    assert generator.latent_shape == latent_shape  # from the configs alone, before build()
    assert generator.is_video == (family == "wan")
    generator.build()
    model = generator.model
    generator.build()  # idempotent
    assert generator.model is model and generator.latent_shape == latent_shape


def test_encode_shapes_and_batch_independence(family: str, generator: FlowGenerator) -> None:
    cond = generator.encode(TEXTS)
    expected = FAMILIES[family][4]
    assert set(cond) == set(expected)
    for key, shape in expected.items():
        assert cond[key].shape == (len(TEXTS), *shape) and cond[key].dtype == torch.float32
    alone = generator.encode([TEXTS[1]])
    for key in cond:
        torch.testing.assert_close(alone[key][0], cond[key][1], rtol=0, atol=1e-6)


def test_velocity_shape_dtype_and_batch_independence(
    generator: FlowGenerator, record_property: pytest.RecordProperty
) -> None:
    latents, sigma, cond = _inputs(generator)
    velocity = generator.velocity(latents, sigma, cond)
    assert velocity.shape == latents.shape and velocity.dtype == torch.float32
    assert torch.isfinite(velocity).all()
    worst = 0.0
    for i in range(len(latents)):
        one = generator.velocity(latents[i : i + 1], sigma[i : i + 1], {k: v[i : i + 1] for k, v in cond.items()})
        worst = max(worst, (one[0] - velocity[i]).abs().max().item())
    record_property("velocity_batch_vs_alone_max_diff", worst)
    print(f"{generator.family}: velocity batch-of-4 vs alone max |diff| = {worst:.3g}")
    assert worst < 1e-5
    # A scalar sigma is broadcast; a mis-shaped one is refused.
    torch.testing.assert_close(generator.velocity(latents[:1], 0.1, {k: v[:1] for k, v in cond.items()}), velocity[:1])
    with pytest.raises(ValueError, match="sigma"):
        generator.velocity(latents, sigma[:2], cond)


def test_decode_shape_and_range(family: str, generator: FlowGenerator) -> None:
    latents = random_latents(generator.latent_shape, 2)
    pixels = generator.decode(latents)
    sizes = FAMILIES[family][2]
    frames = (sizes["num_frames"],) if generator.is_video else ()
    assert pixels.shape == (2, *frames, 3, sizes["height"], sizes["width"])
    assert pixels.dtype == torch.float32 and pixels.min() >= 0.0 and pixels.max() <= 1.0


def test_lora_only_trainable_and_zero_init(generator: FlowGenerator) -> None:
    trainable = [name for name, p in generator.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and name.startswith("model.") for name in trainable)
    lora_b = [p for name, p in generator.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)
    latents, sigma, cond = _inputs(generator, 2)
    velocity = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        with generator.adapter_disabled():  # nested use keeps the adapter off until the outer exit
            pass
        assert all(m.disable_adapters for m in generator.model.modules() if isinstance(m, BaseTunerLayer))
        reference = generator.velocity(latents, sigma, cond)
    assert torch.equal(velocity, reference)
    assert [name for name, p in generator.named_parameters() if p.requires_grad] == trainable
    # Frozen parts stay in eval mode whatever mode the generator is switched to.
    generator.train()
    try:
        frozen = [child for child in generator.children() if child is not generator.model]
        assert generator.model.training and frozen and not any(m.training for c in frozen for m in c.modules())
    finally:
        generator.eval()


def test_perturbed_lora_and_adapter_export(family: str, pipeline_path: Path, tmp_path: Path) -> None:
    generator = _make(pipeline_path, family)
    _perturb_lora(generator)
    latents, sigma, cond = _inputs(generator, 2)
    adapted = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        reference = generator.velocity(latents, sigma, cond)
    assert (adapted - reference).abs().max() > 1e-4

    generator.save_adapter(str(tmp_path))
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    pipe = generator.pipeline_class.from_pretrained(str(pipeline_path))
    before = generator.velocity_of(pipe.transformer, latents, sigma, cond)
    torch.testing.assert_close(before, reference, rtol=0, atol=1e-5)
    pipe.load_lora_weights(str(tmp_path))
    after = generator.velocity_of(pipe.transformer, latents, sigma, cond)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, adapted, rtol=0, atol=1e-5)  # same LoRA scaling alpha / r

    fresh = _make(pipeline_path, family)
    fresh.load_adapter(str(tmp_path))
    torch.testing.assert_close(fresh.velocity(latents, sigma, cond), adapted, rtol=0, atol=1e-6)


def test_bf16_base_with_float32_lora(family: str, pipeline_path: Path) -> None:
    generator = _make(pipeline_path, family, dtype="bfloat16", gradient_checkpointing=True)
    pinned = tuple(generator.model._keep_in_fp32_modules or ())
    frozen = {name: p.dtype for name, p in generator.model.named_parameters() if not p.requires_grad}
    assert {dtype for name, dtype in frozen.items() if not any(m in name for m in pinned)} == {torch.bfloat16}
    assert {p.dtype for p in generator.model.parameters() if p.requires_grad} == {torch.float32}
    latents, sigma, cond = _inputs(generator, 2)
    assert all(value.dtype == torch.float32 for value in cond.values())
    generator.train()  # diffusers checkpoints only in training mode
    velocity = generator.velocity(latents, sigma, cond)
    assert velocity.dtype == torch.float32 and torch.isfinite(velocity).all()
    velocity.square().mean().backward()
    grads = {name: p.grad for name, p in generator.model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    # With B = 0 only the B matrices get a gradient at step 0 (not all: the context queries of SD3's
    # last, context-pre-only block feed outputs that are discarded).
    assert any(torch.count_nonzero(g) > 0 for name, g in grads.items() if "lora_B" in name)


def test_sd3_without_t5_gets_zero_t5_states(tmp_path: Path) -> None:
    generator = _make(make_sd3_pipeline(tmp_path / "no_t5", with_t5=False), "sd3")
    cond = generator.encode(TEXTS[:2])
    assert cond["hidden"].shape == (2, CLIP_LENGTH + TOKENS, 32)
    assert torch.count_nonzero(cond["hidden"][:, CLIP_LENGTH:]) == 0
    assert generator.velocity(*_inputs(generator, 2)).shape == (2, 4, 16, 16)


def test_flux_schnell_has_no_guidance(tmp_path: Path) -> None:
    generator = _make(make_flux_pipeline(tmp_path / "schnell", guidance_embeds=False), "flux")
    assert not generator.model.config.guidance_embeds
    velocity = generator.velocity(*_inputs(generator, 2))
    assert velocity.shape == (2, 4, 16, 16) and torch.isfinite(velocity).all()


def test_missing_folder_and_index_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_generator(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        load_generator(tmp_path)


def test_unsupported_pipeline_lists_supported_classes(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    supported = "FluxPipeline, QwenImageEditPlusPipeline, QwenImagePipeline, StableDiffusion3Pipeline, WanPipeline"
    with pytest.raises(ValueError, match=f"StableDiffusionXLPipeline.*{supported}"):
        load_generator(tmp_path)


def test_wrong_class_for_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="loads StableDiffusion3Pipeline folders"):
        SD3Generator(str(tmp_path)).build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lora_rank": 0}, "lora_rank"),
        ({"lora_alpha": 0.0}, "lora_alpha"),
        ({"lora_target_modules": []}, "lora_target_modules"),
        ({"lora_init": "zeros"}, "lora_init"),
        ({"dtype": "float8"}, "unknown dtype"),
        ({"height": -8}, "height"),
        ({"num_frames": 5}, "num_frames"),
        ({"max_sequence_length": 0}, "max_sequence_length"),
    ],
)
def test_constructor_validates_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SD3Generator(**{"pipeline_path": "unused", **kwargs})


def test_sizes_off_the_latent_grid_are_refused(family: str, pipeline_path: Path) -> None:
    name, bad = {"sd3": ("width", 34), "flux": ("height", 34), "wan": ("num_frames", 6)}[family]
    generator = load_generator(pipeline_path, **{**FAMILIES[family][2], name: bad})
    with pytest.raises(ValueError, match=name):
        generator.latent_shape  # noqa: B018


def test_a_generator_without_a_folder_says_how_to_give_one() -> None:
    generator = SD3Generator()  # the trainer's model.pipeline_path may still set it
    with pytest.raises(ValueError, match="model.pipeline_path"):
        generator.build()
