"""Qwen-Image against diffusers' own ``QwenImagePipeline`` on a tiny folder in the published layout.

Every reference here is the pipeline's computation, not a formula of ours: its ``encode_prompt`` for the
features, its transformer call for the velocity, its sampling loop (schedule, true CFG with the norm rescale,
Euler steps, latent un-normalisation, VAE decode) for whole samples, the sigmas and ``mu`` its scheduler gets in a
real call for the schedule, and its ``load_lora_weights`` for the exported adapter.

Batch invariance: a prompt's image is the same alone and batched with a much longer prompt, to the bit here;
the failing twin pads the batch to its longest prompt with the padding attended (it reaches the image tokens'
attention, with RoPE positions of its own, as diffusers' pipeline did before its joint attention mask), and the
same comparison then fails by orders of magnitude.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from tests.helpers import ROOT, built_generator
from tests.pipelines import QWENIMAGE_SCHEDULER, QWENIMAGE_TEXT_WIDTH, make_qwenimage_pipeline, random_latents
from unirl_pl.generators import QwenImageGenerator
from unirl_pl.generators.qwenimage import QWENIMAGE_LORA_TARGETS, TEMPLATE_TOKENS
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.loops.diffusion_denoise import write_schedule
from unirl_pl.plan.models import SHIPPED

TOKENS = 32  # max_sequence_length: the fixed text width of the tiny runs
SIZE = {"height": 32, "width": 32}
TEXTS = ["a red cat on the left", "b", "two big blue squares"]
SHORT = "a cat"
LONG = " ".join(["a big red cat on the left of a small blue dog"] * 2)  # 22 words: a much longer prompt
RECIPE = ROOT / "recipes" / "qwenimage.yaml"


def _generator(folder: Path, **overrides: object) -> QwenImageGenerator:
    return built_generator(folder, QwenImageGenerator, TOKENS, SIZE, **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwenimage_pipeline(tmp_path_factory.mktemp("qwenimage"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> QwenImageGenerator:
    return _generator(folder)


@pytest.fixture(scope="module")
def pipe(folder: Path) -> QwenImagePipeline:
    return QwenImagePipeline.from_pretrained(str(folder))


def _perturb_lora(generator: QwenImageGenerator) -> None:
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


def _pipeline_velocity(pipe: QwenImagePipeline, latents: torch.Tensor, sigma: torch.Tensor, text: str) -> torch.Tensor:
    """One prompt's velocity as ``QwenImagePipeline.__call__`` computes it for one step: its ``encode_prompt`` of
    the prompt alone (no padding, mask None), its packing, ``img_shapes`` and ``timestep / 1000`` of the
    scheduler's ``sigma * 1000``, then its unpacking."""
    batch, channels, height, width = latents.shape
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt([text] * batch, max_sequence_length=TOKENS)
        out = pipe.transformer(
            hidden_states=pipe._pack_latents(latents, batch, channels, height, width),
            timestep=(sigma * 1000).to(torch.float32) / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=[[(1, height // 2, width // 2)]] * batch,
            return_dict=False,
        )[0]
    return pipe._unpack_latents(
        out, height * pipe.vae_scale_factor, width * pipe.vae_scale_factor, pipe.vae_scale_factor
    )[:, :, 0]


# ------------------------------------------------------------------ the folder
def test_fixture_is_the_published_layout(folder: Path) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert index["vae"] == ["diffusers", "AutoencoderKLQwenImage"]
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    for part in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        assert (folder / part).is_dir(), part
    shipped = json.loads((SHIPPED / "Qwen-Image" / "scheduler" / "scheduler_config.json").read_text())
    assert {k: shipped[k] for k in QWENIMAGE_SCHEDULER} == QWENIMAGE_SCHEDULER, "the tiny folder has the real schedule"
    # The tokenizer splits the pipeline's template so that its system turn and user header are the 34 tokens the
    # pipeline drops (as Qwen2.5-VL's BPE does).
    generator = QwenImageGenerator(str(folder), **SIZE)
    assert generator.latent_shape == (4, 8, 8) and generator.vae_scale_factor() == 4
    assert TEMPLATE_TOKENS == 34


# ------------------------------------------------------------------ conditioning and velocity
def test_features_are_the_pipelines_encode_prompt_padded_to_a_fixed_width(
    generator: QwenImageGenerator, pipe: QwenImagePipeline
) -> None:
    cond = generator.encode(TEXTS)
    assert set(cond) == {"hidden", "mask"} and cond["hidden"].dtype == torch.float32
    assert cond["hidden"].shape == (len(TEXTS), TOKENS, QWENIMAGE_TEXT_WIDTH) and cond["mask"].shape == (3, TOKENS)
    for i, text in enumerate(TEXTS):
        with torch.no_grad():
            expected, mask = pipe.encode_prompt([text], max_sequence_length=TOKENS)
        length = expected.shape[1]
        assert mask is None, "one prompt alone: no padding, the pipeline drops the mask"
        torch.testing.assert_close(cond["hidden"][i, :length], expected[0], rtol=0, atol=0)
        assert cond["mask"][i].tolist() == [1.0] * length + [0.0] * (TOKENS - length)
        assert not cond["hidden"][i, length:].any(), "the padding is zeros"
    # Truncated to max_sequence_length as encode_prompt does.
    short = _generator(generator.pipeline_path, max_sequence_length=4).encode([TEXTS[0]])
    assert short["mask"].tolist() == [[1.0] * 4]
    torch.testing.assert_close(short["hidden"][0], cond["hidden"][0, :4], rtol=0, atol=0)
    with pytest.raises(ValueError, match="at most 1024"):
        QwenImageGenerator(str(generator.pipeline_path), max_sequence_length=1025)


def test_velocity_is_the_pipelines_transformer_call(generator: QwenImageGenerator, pipe: QwenImagePipeline) -> None:
    latents = random_latents(generator.latent_shape, 3)
    sigma = torch.tensor([0.95, 0.5, 0.1])
    cond = generator.encode(TEXTS)
    ours = generator.velocity(latents, sigma, cond)
    for i, text in enumerate(TEXTS):
        expected = _pipeline_velocity(pipe, latents[i : i + 1], sigma[i : i + 1], text)
        # The pipeline runs the prompt unpadded; ours has masked padding: equal up to the attention's rounding.
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=1e-5)
    # Our padded features and mask through the pipeline's own transformer call: the same computation.
    with torch.no_grad():
        out = pipe.transformer(
            hidden_states=pipe._pack_latents(latents, 3, 4, 8, 8),
            timestep=sigma,
            encoder_hidden_states=cond["hidden"],
            encoder_hidden_states_mask=cond["mask"],
            img_shapes=[[(1, 4, 4)]] * 3,
            return_dict=False,
        )[0]
    torch.testing.assert_close(ours, pipe._unpack_latents(out, 32, 32, 4)[:, :, 0], rtol=0, atol=0)


# ------------------------------------------------------------------ batch invariance and its failing twin
Encoder = Callable[[QwenImageGenerator, list[str]], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def _own_width(generator: QwenImageGenerator, texts: list[str]) -> tuple[dict, dict]:
    """The generator's features of ``texts`` and of the empty prompt (the unguided branch), as a fit makes them."""
    return generator.encode(texts), generator.encode([""])


def _padded_to_the_batch(generator: QwenImageGenerator, texts: list[str]) -> tuple[dict, dict]:
    """The trap: the prompts and the negative prompt in one batch padded to its longest prompt (as Flow-GRPO's
    ``pipeline_with_logprob`` encodes ``prompt + negative_prompt``), every position attended (the mask all ones),
    so the padding enters the image tokens' attention at RoPE positions of its own."""
    rows = [generator.prompt_features(text) for text in [*texts, ""]]
    width = max(row.shape[0] for row in rows)
    hidden = torch.stack([torch.cat([r, r.new_zeros(width - r.shape[0], r.shape[1])]) for r in rows]).float()
    mask = torch.ones(hidden.shape[:2])
    return {"hidden": hidden[:-1], "mask": mask[:-1]}, {"hidden": hidden[-1:], "mask": mask[-1:]}


def _alone_vs_batched(generator: QwenImageGenerator, encode: Encoder) -> tuple[float, float]:
    """The largest difference of ``SHORT``'s latents and image, sampled alone and batched with ``LONG`` (four
    guided ODE steps through the loop, each sample's start noise its own), as (latents, pixels)."""
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=4, guidance_scale=4.0))
    cond, uncond = encode(generator, [SHORT])
    alone, _ = loop.sample(cond, [7], [0], "serve", seed=3, uncond=uncond)
    cond, uncond = encode(generator, [SHORT, LONG])
    batched, _ = loop.sample(cond, [7, 8], [0, 0], "serve", seed=3, uncond=uncond)
    latents = (batched[:1] - alone).abs().max().item()
    pixels = (generator.decode(batched[:1]) - generator.decode(alone)).abs().max().item()
    return latents, pixels


def test_a_samples_image_does_not_depend_on_the_other_prompts_of_its_batch(generator: QwenImageGenerator) -> None:
    lengths = [generator.prompt_features(t).shape[0] for t in (SHORT, LONG)]
    assert lengths[1] >= 4 * lengths[0], lengths
    latents, pixels = _alone_vs_batched(generator, _own_width)
    print(f"alone vs batched with a {lengths[1]}-token prompt: latents {latents:.3e}, pixels {pixels:.3e}")
    assert latents == 0.0 and pixels == 0.0, "bitwise the same image"


def test_the_twin_with_padding_reaching_the_positions_fails(generator: QwenImageGenerator) -> None:
    latents, pixels = _alone_vs_batched(generator, _padded_to_the_batch)
    print(f"twin (batch padding attended): latents {latents:.3e}, pixels {pixels:.3e}")
    assert latents > 1e-3, "the comparison the real test makes fails when padding reaches the positions"
    with pytest.raises(AssertionError, match="bitwise"):
        assert latents == 0.0 and pixels == 0.0, "bitwise the same image"


# ------------------------------------------------------------------ schedule, guidance and decode
def _spied_pipeline_call(pipe: QwenImagePipeline, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> dict:
    """A real ``pipe(...)`` call; returns the ``sigmas`` and ``mu`` its ``set_timesteps`` received and the
    sigmas it left on the scheduler."""
    seen: dict = {}
    original = type(pipe.scheduler).set_timesteps

    @functools.wraps(original)  # the pipeline inspects its signature for ``sigmas``
    def spy(self, *args, **kw):
        seen.update(mu=kw.get("mu"), given=list(kw.get("sigmas")))
        return original(self, *args, **kw)

    monkeypatch.setattr(type(pipe.scheduler), "set_timesteps", spy)
    pipe(prompt="a red cat", max_sequence_length=TOKENS, output_type="latent", true_cfg_scale=1.0, **kwargs)
    seen["sigmas"] = pipe.scheduler.sigmas.to(torch.float64)
    return seen


@pytest.mark.parametrize("num_steps", [4, 7])
def test_schedule_json_is_the_sigmas_and_mu_of_a_real_pipeline_call(
    folder: Path, pipe: QwenImagePipeline, num_steps: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedules = []
    for height, width in [(32, 32), (64, 32)]:
        generator = QwenImageGenerator(str(folder), height=height, width=width)
        seen = _spied_pipeline_call(pipe, monkeypatch, height=height, width=width, num_inference_steps=num_steps)
        loop = DiffusionDenoise(generator, RolloutConfig(num_steps=num_steps))
        written = write_schedule(loop, tmp_path / f"{height}x{width}")
        described = json.loads((tmp_path / f"{height}x{width}" / "schedule.json").read_text())
        assert described == json.loads(json.dumps(written))
        ours = torch.tensor(described["sigmas"], dtype=torch.float64)
        assert ours.shape == (num_steps + 1,) and ours[0] == 1.0 and ours[-1] == 0.0
        torch.testing.assert_close(ours, seen["sigmas"], rtol=0, atol=1e-7)
        assert described["details"]["mu"] == seen["mu"], "mu from the image's packed token count"
        assert described["details"]["shift_terminal"] == 0.02 and float(ours[-2]) == pytest.approx(0.02, abs=1e-6)
        schedules.append(ours)
    # mu grows with the image's token count: the larger image is shifted towards noise (the last sigma before 0 is
    # shift_terminal at either size).
    assert (schedules[1][1:-2] > schedules[0][1:-2]).all() and float(schedules[1][-2]) == pytest.approx(
        float(schedules[0][-2]), abs=1e-6
    )


def test_schedule_at_the_recipes_setting_is_diffusers_own() -> None:
    """At 512 px and 10 steps on the shipped Qwen-Image scheduler config, the generator's sigmas are those of
    diffusers' own helpers called as ``QwenImagePipeline.__call__`` calls them."""
    model = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]
    size, steps = model["generator"]["init_args"], model["rollout"]["num_steps"]
    assert (size["height"], size["width"], steps) == (512, 512, 10)
    folder = SHIPPED / "Qwen-Image"
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder), subfolder="scheduler")
    config = scheduler.config
    tokens = (512 // 16) * (512 // 16)
    mu = calculate_shift(
        tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"], config["max_shift"]
    )
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    schedule = QwenImageGenerator(str(folder), height=512, width=512).schedule(steps)
    torch.testing.assert_close(schedule.sigmas, scheduler.sigmas.to(torch.float64), rtol=0, atol=1e-7)
    assert schedule.details["mu"] == pytest.approx(0.5387096774, abs=1e-9) == mu


def test_sampling_and_decode_reproduce_the_pipeline(generator: QwenImageGenerator, pipe: QwenImagePipeline) -> None:
    """Four ODE steps through the loop with true CFG 4.0 (the empty negative prompt, the norm rescale) and
    ``decode`` equal ``pipe(...)`` from the same noise: its latents after every step and its images."""
    noise = random_latents(generator.latent_shape, 2, seed=3)
    texts = TEXTS[:2]
    steps: list[torch.Tensor] = []

    def capture(_pipe, _i, _t, kwargs):
        steps.append(kwargs["latents"].clone())
        return {}

    images = pipe(
        prompt=texts,
        negative_prompt=["", ""],
        true_cfg_scale=4.0,
        latents=pipe._pack_latents(noise.clone(), 2, 4, 8, 8),
        num_inference_steps=4,
        max_sequence_length=TOKENS,
        output_type="pt",
        callback_on_step_end=capture,
        **SIZE,
    ).images
    loop = DiffusionDenoise(generator, RolloutConfig(num_steps=4, guidance_scale=4.0))
    cond, uncond = generator.encode(texts), generator.encode([""])
    sigmas = loop.sigmas(4).float()
    x = noise.clone()
    with torch.no_grad():
        for i in range(4):
            x = x + (sigmas[i + 1] - sigmas[i]) * loop.velocity(x, sigmas[i], cond, uncond)
            torch.testing.assert_close(pipe._pack_latents(x, 2, 4, 8, 8), steps[i], rtol=0, atol=1e-5)
    torch.testing.assert_close(generator.decode(x), images, rtol=0, atol=1e-5)


def test_guidance_rescales_each_token_to_the_conditional_norm(generator: QwenImageGenerator) -> None:
    v_c, v_u = random_latents(generator.latent_shape, 2, seed=1), random_latents(generator.latent_shape, 2, seed=2)
    guided = generator.guide(v_c, v_u, 4.0)
    packed = QwenImagePipeline._pack_latents
    norms = [torch.linalg.vector_norm(packed(t, 2, 4, 8, 8), dim=-1) for t in (guided, v_c)]
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    direction = packed(v_u + 4.0 * (v_c - v_u), 2, 4, 8, 8)
    cosine = torch.nn.functional.cosine_similarity(packed(guided, 2, 4, 8, 8), direction, dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


# ------------------------------------------------------------------ LoRA
def test_lora_targets_and_export_load_through_the_pipeline(folder: Path, tmp_path: Path) -> None:
    generator = _generator(folder)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in generator.model.named_modules() if name.endswith("lora_A")}
    for block in (0, 1):
        assert {f"transformer_blocks.{block}.{t}" for t in QWENIMAGE_LORA_TARGETS} <= adapted
    assert len(adapted) == 2 * len(QWENIMAGE_LORA_TARGETS), "both streams' attention and MLPs, nothing else"
    assert generator.lora_config().r == 4

    _perturb_lora(generator)
    latents, sigma = random_latents(generator.latent_shape, 1), torch.tensor([0.7])
    cond = generator.encode([TEXTS[0]])
    trained = generator.velocity(latents, sigma, cond)
    with generator.adapter_disabled():
        reference = generator.velocity(latents, sigma, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    pipe = QwenImagePipeline.from_pretrained(str(folder))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS[0]), reference, rtol=0, atol=1e-5)
    pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(_pipeline_velocity(pipe, latents, sigma, TEXTS[0]), trained, rtol=0, atol=1e-5)
    fresh = _generator(folder)
    fresh.load_adapter(str(tmp_path))
    torch.testing.assert_close(fresh.velocity(latents, sigma, cond), trained, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the recipe
def test_recipe_is_flow_grpos_qwenimage_setting() -> None:
    """recipes/qwenimage.yaml as written: Flow-GRPO's pickscore_qwenimage_8gpu values (docs/reproduce.md)."""
    config = yaml.safe_load(RECIPE.read_text())
    model = config["model"]["init_args"]
    generator = model["generator"]
    assert generator["class_path"].endswith("QwenImageGenerator")
    args = generator["init_args"]
    assert (args["lora_rank"], args["lora_alpha"], args["lora_init"]) == (64, 128.0, "gaussian")
    assert (args["height"], args["width"], args["vae_dtype"], args["gradient_checkpointing"]) == (
        512,
        512,
        "float32",
        True,
    )
    assert model["generator_algorithm"]["init_args"] == {"sde_window": [3, 5], "noise_level": 1.2}
    assert (model["rollout"]["num_steps"], model["rollout"]["guidance_scale"]) == (10, 4.0)
    loss = model["transformer_loss"]
    assert (loss["clip_eps"], loss["beta"], loss["grad_clip"], loss["mini_batches"]) == (1.0e-4, 0.0, 1.0, 2)
    assert model["advantage"] == {"scheme": "shared", "global_std": True, "clip_max": 5.0}
    assert model["eval_sampler"] == {"num_steps": 50} and "ema" not in model
    assert config["trainer"]["devices"] == 8
    data = config["data"]["init_args"]
    assert (data["prompts_per_step"], data["samples_per_prompt"]) == (32, 16)


def _cpu_args(tmp_path: Path, folder: Path, refiner: str) -> list[str]:
    from tests.test_rewards_recipes import cpu_block

    args = cpu_block(RECIPE, {"/tmp/tiny-qwenimage": str(folder), "/tmp/tiny-qwen": refiner})
    assert args and not any("/tmp/tiny" in a for a in args)
    return [
        *args,
        f"--trainer.logger.init_args.save_dir={tmp_path}/runs",
        f"--trainer.default_root_dir={tmp_path}/runs",
        f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
    ]


@pytest.mark.integration
@pytest.mark.slow
def test_recipe_runs_its_header_cpu_block_with_gates_green(tmp_path: Path, folder: Path) -> None:
    """The header's CPU block: two guided joint steps, C2 of both experts <= 1e-5 in float32, interleave parity
    within the recipe's tolerance, and schedule.json the sigmas of the pipeline for that size and step count."""
    from tests.chat_lm import make_qwen2_chat_lm
    from tests.helpers import read_metrics, series
    from unirl_pl.callbacks import InterleaveParityCheck
    from unirl_pl.cli import main

    refiner = make_qwen2_chat_lm(tmp_path / "qwen")
    cli = main(["fit", "--config", str(RECIPE), *_cpu_args(tmp_path, folder, refiner)])
    assert cli.trainer.state.status == "finished" and isinstance(cli.model.generator, QwenImageGenerator)
    rows = read_metrics(cli)
    for expert in ("llm", "transformer"):
        c2 = series(rows, f"c2/{expert}_max_abs_diff")
        print(f"c2/{expert}_max_abs_diff: {c2}")
        assert len(c2) == 2 and max(c2) <= 1e-5, (expert, c2)
    (check,) = [c for c in cli.trainer.callbacks if isinstance(c, InterleaveParityCheck)]
    parity = series(rows, "parity/max_abs_diff")
    print(f"parity/max_abs_diff: {parity}")
    assert parity and max(parity) <= check.tolerance
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    pipe = QwenImagePipeline.from_pretrained(str(folder))
    pipe(prompt="a red cat", height=32, width=32, num_inference_steps=4, output_type="latent", true_cfg_scale=1.0)
    expected = pipe.scheduler.sigmas.to(torch.float64)
    torch.testing.assert_close(torch.tensor(schedule["sigmas"], dtype=torch.float64), expected, rtol=0, atol=1e-7)
    assert schedule["sde_steps"] == [1, 2]


# ------------------------------------------------------------------ plan
@pytest.mark.slow
def test_plan_builds_qwen_image_at_its_published_size() -> None:
    """The shipped Qwen-Image configs build the published sizes (a 20.43B DiT, Qwen2.5-VL-7B's 8.29B, the
    16-channel VAE), and the plan's fake generator encodes and predicts at 512 px through the family code."""
    from diffusers import QwenImageTransformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import Qwen2_5_VLForConditionalGeneration

    from unirl_pl.plan.models import DEFAULT_PIPELINES, build_generator, meta_model
    from unirl_pl.plan.phases import text_encode

    folder = SHIPPED / DEFAULT_PIPELINES["QwenImageGenerator"]
    dit = meta_model(QwenImageTransformer2DModel, folder / "transformer", torch.bfloat16)
    qwen = meta_model(Qwen2_5_VLForConditionalGeneration, folder / "text_encoder", torch.bfloat16)
    assert sum(p.numel() for p in dit.parameters()) == 20_430_401_088
    assert sum(p.numel() for p in qwen.parameters()) == 8_292_166_656
    mode = FakeTensorMode()
    generator, _ = build_generator(QwenImageGenerator, {"height": 512, "width": 512}, folder, mode)
    assert generator.latent_shape == (16, 64, 64)
    with mode:
        cond = text_encode(generator, 2)
        assert cond["hidden"].shape == (2, 512, 3584) and cond["mask"].shape == (2, 512)
        latents = torch.empty(2, *generator.latent_shape)
        assert generator.velocity(latents, torch.full((2,), 0.5), cond).shape == latents.shape
