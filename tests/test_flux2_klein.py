"""FLUX.2 [klein] against diffusers' own ``Flux2KleinPipeline`` on tiny base and step-distilled folders.

Every reference here is the pipeline's computation, not a formula of ours: its ``encode_prompt`` for the
features, its transformer call for the velocity, its sampling loop (schedule, true CFG on the base model,
Euler steps, batch-norm denormalisation, unpatchify, VAE decode) for whole samples, its scheduler's sigmas
after a real call for the schedule, and its ``load_lora_weights`` for the exported adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from diffusers import Flux2KleinPipeline

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, built_generator, read_metrics, series
from tests.pipelines import KLEIN_TEXT_LAYERS, KLEIN_TEXT_WIDTH, make_flux2_klein_pipeline, random_latents
from unirl_pl.cli import main
from unirl_pl.generators import Flux2KleinGenerator, load_generator
from unirl_pl.loops import DiffusionDenoise, RolloutConfig

TOKENS = 32  # max_sequence_length: the chat template plus a short prompt fit
SIZE = {"height": 32, "width": 32}
TEXTS = ["a red cat on the left", "b", "two big blue squares"]


def _generator(folder: Path, **overrides: object) -> Flux2KleinGenerator:
    return built_generator(folder, Flux2KleinGenerator, TOKENS, SIZE, **overrides)


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_flux2_klein_pipeline(tmp_path_factory.mktemp("klein_base"))


@pytest.fixture(scope="module")
def distilled_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_flux2_klein_pipeline(tmp_path_factory.mktemp("klein_distilled"), distilled=True, seed=1)


@pytest.fixture(scope="module")
def base(base_folder: Path) -> Flux2KleinGenerator:
    return _generator(base_folder)


@pytest.fixture(scope="module")
def pipe(base_folder: Path) -> Flux2KleinPipeline:
    return Flux2KleinPipeline.from_pretrained(str(base_folder))


def _perturb_lora(generator: Flux2KleinGenerator) -> None:
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


def pipeline_velocity(
    pipe: Flux2KleinPipeline,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    texts: list[str],
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The velocity as ``Flux2KleinPipeline.__call__`` computes it for one step: its latent packing and ids,
    its prompt embeddings and text ids, ``timestep / 1000`` of the scheduler's ``sigma * 1000``, then its
    unpacking by position ids. With ``reference`` (its tokens and ids, as ``prepare_image_latents`` gives them)
    they follow the target's, and the prediction of the target tokens is kept, as a call with ``image=`` does."""
    with torch.no_grad():
        embeds, text_ids = pipe.encode_prompt(texts, max_sequence_length=TOKENS)
        packed, latent_ids = pipe.prepare_latents(
            len(texts), 0, SIZE["height"], SIZE["width"], torch.float32, "cpu", None, latents=latents
        )
        tokens, ids = packed, latent_ids
        if reference is not None:
            tokens, ids = torch.cat([packed, reference[0]], dim=1), torch.cat([latent_ids, reference[1]], dim=1)
        timestep = (sigma * 1000).to(torch.float32)
        out = pipe.transformer(
            hidden_states=tokens,
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=ids,
            return_dict=False,
        )[0][:, : packed.shape[1]]
    _, _, height, width = latents.shape
    return pipe._unpack_latents_with_ids(out, latent_ids, height, width)


# ------------------------------------------------------------------ conditioning and velocity
def test_features_are_the_pipelines_encode_prompt(base: Flux2KleinGenerator, pipe: Flux2KleinPipeline) -> None:
    cond = base.encode(TEXTS)
    assert set(cond) == {"hidden"} and cond["hidden"].dtype == torch.float32
    assert cond["hidden"].shape == (len(TEXTS), TOKENS, 3 * KLEIN_TEXT_WIDTH), "layers 9, 18, 27 stacked"
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(TEXTS, max_sequence_length=TOKENS)
    torch.testing.assert_close(cond["hidden"], expected, rtol=0, atol=1e-6)
    alone = base.encode([TEXTS[1]])["hidden"][0]
    torch.testing.assert_close(alone, cond["hidden"][1], rtol=0, atol=1e-6)


def test_other_feature_layers_follow_the_pipeline_and_bad_ones_are_refused(base_folder: Path) -> None:
    # Width 3 x 16 is what the tiny transformer reads, so any three layers load; the pipeline must agree.
    layers = (1, 14, KLEIN_TEXT_LAYERS)
    generator = _generator(base_folder, text_encoder_out_layers=layers)
    pipe = Flux2KleinPipeline.from_pretrained(str(base_folder))
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(TEXTS[:2], max_sequence_length=TOKENS, text_encoder_out_layers=layers)
    torch.testing.assert_close(generator.encode(TEXTS[:2])["hidden"], expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="hidden states are indices 0..28"):
        _generator(base_folder, text_encoder_out_layers=(9, 18, 29))
    with pytest.raises(ValueError, match="joint_attention_dim is 48"):
        _generator(base_folder, text_encoder_out_layers=(9, 18))


def test_velocity_is_the_pipelines_transformer_call(base: Flux2KleinGenerator, pipe: Flux2KleinPipeline) -> None:
    assert base.latent_shape == (16, 8, 8), "the pipeline's patchified grid: 4 VAE channels x 2 x 2, 32 px / 4"
    latents = random_latents(base.latent_shape, 3)
    sigma = torch.tensor([0.95, 0.5, 0.1])
    expected = pipeline_velocity(pipe, latents, sigma, TEXTS)
    cond = base.encode(TEXTS)
    torch.testing.assert_close(base.velocity(latents, sigma, cond), expected, rtol=0, atol=1e-5)
    worst = max(
        (base.velocity(latents[i : i + 1], sigma[i : i + 1], {"hidden": cond["hidden"][i : i + 1]})[0] - expected[i])
        .abs()
        .max()
        .item()
        for i in range(3)
    )
    assert worst <= 1e-5, "a row's velocity does not depend on its batch"


# ------------------------------------------------------------------ schedule, guidance and decode
@pytest.mark.parametrize("num_steps", [4, 7])
def test_schedule_is_the_sigmas_of_a_real_pipeline_call(base_folder: Path, pipe: Flux2KleinPipeline, num_steps: int):
    schedules = []
    for height, width in [(32, 32), (64, 32)]:
        generator = load_generator(base_folder, height=height, width=width)
        pipe(
            prompt="a red cat",
            height=height,
            width=width,
            num_inference_steps=num_steps,
            guidance_scale=1.0,
            max_sequence_length=TOKENS,
            output_type="latent",
        )
        expected = pipe.scheduler.sigmas.to(torch.float64)
        ours = generator.schedule(num_steps).sigmas
        assert ours.shape == (num_steps + 1,) and ours[0] == 1.0 and ours[-1] == 0.0
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-7)
        torch.testing.assert_close(
            DiffusionDenoise(generator, RolloutConfig(num_steps=num_steps)).sigmas(num_steps), ours
        )
        schedules.append(ours)
    # mu grows with the image's token count: the larger image is shifted towards noise.
    assert (schedules[1][1:-1] > schedules[0][1:-1]).all()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["base", "distilled"])
def test_sampling_and_decode_reproduce_the_pipeline(
    variant: str, base: Flux2KleinGenerator, pipe: Flux2KleinPipeline, distilled_folder: Path
) -> None:
    """Four ODE steps through the loop (guided with the empty prompt at 4.0 on the base model, as PromptRL
    samples klein-base; unguided on the distilled one) and ``decode`` equal ``pipe(...)`` from the same noise:
    its latents after every step and its images."""
    generator, reference, scale = base, pipe, 4.0
    if variant == "distilled":
        generator = _generator(distilled_folder)
        reference, scale = Flux2KleinPipeline.from_pretrained(str(distilled_folder)), 1.0
    noise = random_latents(generator.latent_shape, 2, seed=3)
    texts = TEXTS[:2]
    steps: list[torch.Tensor] = []

    def capture(_pipe, _i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return {}

    images = reference(
        prompt=texts,
        latents=noise.clone(),
        num_inference_steps=4,
        guidance_scale=scale,
        max_sequence_length=TOKENS,
        output_type="pt",
        callback_on_step_end=capture,
        **SIZE,
    ).images
    config = RolloutConfig(num_steps=4, guidance_scale=scale)
    loop = DiffusionDenoise(generator, config)
    cond = generator.encode(texts)
    uncond = generator.encode([""]) if config.guided else None
    assert config.guided == (variant == "base")
    sigmas = loop.sigmas(4).float()
    x = noise.clone()
    with torch.no_grad():
        for i in range(4):
            x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, uncond)
            torch.testing.assert_close(Flux2KleinPipeline._pack_latents(x), steps[i], rtol=0, atol=1e-5)
    torch.testing.assert_close(generator.decode(x), images, rtol=0, atol=1e-5)
    if variant == "distilled":
        # The pipeline ignores guidance on a distilled folder, which is why the generator refuses it.
        again = reference(
            prompt=texts, latents=noise.clone(), num_inference_steps=4, guidance_scale=4.0,
            max_sequence_length=TOKENS, output_type="pt", **SIZE,
        ).images  # fmt: skip
        torch.testing.assert_close(again, images, rtol=0, atol=0)


def test_guidance_is_refused_on_a_distilled_folder_only(base_folder: Path, distilled_folder: Path) -> None:
    distilled = Flux2KleinGenerator(str(distilled_folder), **SIZE)
    assert distilled.is_distilled and not Flux2KleinGenerator(str(base_folder), **SIZE).is_distilled
    with pytest.raises(ValueError, match=r"^model.rollout.guidance_scale=4.0: .*step-distilled.*is_distilled"):
        distilled.check_guidance(4.0, "model.rollout.guidance_scale")
    distilled.check_guidance(1.0, "model.rollout.guidance_scale")
    Flux2KleinGenerator(str(base_folder), **SIZE).check_guidance(4.0, "model.rollout.guidance_scale")


# ------------------------------------------------------------------ LoRA
def test_lora_targets_and_export_load_through_the_pipeline(base_folder: Path, tmp_path: Path) -> None:
    generator = _generator(base_folder)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in generator.model.named_modules() if name.endswith("lora_A")}
    for target in ("attn.to_q", "attn.add_v_proj", "attn.to_out.0", "ff.linear_in", "ff_context.linear_out"):
        assert f"transformer_blocks.0.{target}" in adapted, target
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in adapted
    assert "single_transformer_blocks.0.attn.to_out" not in adapted, "Flow-Factory's list leaves it frozen"

    _perturb_lora(generator)
    latents, sigma = random_latents(generator.latent_shape, 2), torch.tensor([0.7, 0.2])
    cond = generator.encode(TEXTS[:2])
    trained = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        reference = generator.velocity(latents, sigma, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = Flux2KleinPipeline.from_pretrained(str(base_folder))
    torch.testing.assert_close(pipeline_velocity(pipe, latents, sigma, TEXTS[:2]), reference, rtol=0, atol=1e-5)
    pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(pipeline_velocity(pipe, latents, sigma, TEXTS[:2]), trained, rtol=0, atol=1e-5)
    fresh = _generator(base_folder)
    fresh.load_adapter(str(tmp_path))
    torch.testing.assert_close(fresh.velocity(latents, sigma, cond), trained, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the family in a fit
def _klein_recipe(tmp_path: Path, guidance_scale: float) -> Path:
    """recipes/flux.yaml with the klein generator in place of FLUX.1's and classifier-free guidance set."""
    config = yaml.safe_load((ROOT / "recipes" / "flux.yaml").read_text())
    model = config["model"]["init_args"]
    model["generator"] = {
        "class_path": "unirl_pl.generators.Flux2KleinGenerator",
        "init_args": {"lora_rank": 4, "lora_alpha": 8.0, "dtype": "float32", "max_sequence_length": TOKENS, **SIZE},
    }
    model["rollout"]["guidance_scale"] = guidance_scale
    path = tmp_path / "klein.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cpu(tmp_path: Path, pipeline: Path, refiner: str) -> list[str]:
    return [
        f"--model.pipeline_path={pipeline}",
        f"--model.llm.init_args.pretrained_path={refiner}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--model.llm.init_args.dtype=float32",
        "--data.prompts_per_step=2",
        "--data.samples_per_prompt=2",
        "--model.rollout.num_steps=4",
        "--model.generator_algorithm.init_args.sde_window=[0,2]",
        "--model.rollout.max_new_tokens=12",
        "--data.val_batch_size=2",
        "--trainer.limit_val_batches=0",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_model_summary=false",
        "--trainer.max_steps=2",
        f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
    ]


@pytest.mark.integration
def test_klein_base_trains_two_guided_steps_with_gates_green(tmp_path: Path, base_folder: Path) -> None:
    refiner = make_qwen2_chat_lm(tmp_path / "qwen")
    recipe = _klein_recipe(tmp_path, guidance_scale=4.0)
    cli = main(["fit", "--config", str(recipe), *_cpu(tmp_path, base_folder, refiner)])
    assert isinstance(cli.model.generator, Flux2KleinGenerator)
    rows = read_metrics(cli)
    assert len(series(rows, "reward/mean")) == 2
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert max(series(rows, "c2/transformer_max_abs_diff")) <= 1e-5
    parity = series(rows, "parity/max_abs_diff")
    assert parity and max(parity) <= 1e-5, "interleave parity ran and is green"
    assert cli.model.ledger["transformer"] == 2 * cli.model.losses["transformer"].mini_batches


@pytest.mark.integration
def test_a_fit_refuses_guidance_on_a_distilled_klein(tmp_path: Path, distilled_folder: Path) -> None:
    recipe = _klein_recipe(tmp_path, guidance_scale=4.0)
    with pytest.raises(ValueError, match="model.rollout.guidance_scale=4.0: .*step-distilled"):
        main(["--config", str(recipe), *_cpu(tmp_path, distilled_folder, "unused")], run=False)


# ------------------------------------------------------------------ plan
@pytest.mark.slow
def test_plan_builds_klein_base_4b_at_its_published_size() -> None:
    """The shipped FLUX.2-klein-base-4B configs build the published sizes (a 3.88B DiT, the Qwen3-4B encoder),
    and the plan's fake generator encodes and predicts at 512 px through the same family code."""
    from diffusers import Flux2Transformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import Qwen3ForCausalLM

    from unirl_pl.plan.models import DEFAULT_PIPELINES, SHIPPED, build_generator, meta_model
    from unirl_pl.plan.phases import text_encode

    folder = SHIPPED / DEFAULT_PIPELINES["Flux2KleinGenerator"]
    dit = meta_model(Flux2Transformer2DModel, folder / "transformer", torch.bfloat16)
    qwen = meta_model(Qwen3ForCausalLM, folder / "text_encoder", torch.bfloat16)
    assert round(sum(p.numel() for p in dit.parameters()) / 1e9, 2) == 3.88
    assert round(sum(p.numel() for p in qwen.parameters()) / 1e9, 2) == 4.02
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    generator, _ = build_generator(Flux2KleinGenerator, {"height": 512, "width": 512}, folder, mode)
    assert generator.latent_shape == (128, 32, 32) and not generator.is_distilled
    with mode:
        cond = text_encode(generator, 2)
        assert cond["hidden"].shape == (2, 512, 3 * 2560)
        latents = torch.empty(2, *generator.latent_shape)
        assert generator.velocity(latents, torch.full((2,), 0.5), cond).shape == latents.shape
