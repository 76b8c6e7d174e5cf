"""Wan2.2-TI2V-5B (text-to-video) against diffusers' own ``WanPipeline`` on a tiny folder in the published layout.

Every reference here is the pipeline's computation, not a formula of ours: the sigmas its scheduler holds after a real
call, its transformer call with the per-token timesteps ``WanPipeline.__call__`` builds when the folder sets
``expand_timesteps`` (``mask[0][0][:, ::2, ::2] * t``, flattened, one row per sample), its decode with the 48-channel
``latents_mean``/``latents_std``, and its ``load_lora_weights`` for the exported adapter. The recipe's CPU block is read
from its header and run.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, built_generator, read_metrics, series
from tests.pipelines import WAN22_TI2V_FLOW_SHIFT, make_wan22_ti2v_pipeline, random_latents
from unirl_pl.cli import main
from unirl_pl.generators import WanGenerator, load_generator
from unirl_pl.plan.models import SHIPPED

RECIPE = ROOT / "recipes" / "wan22_ti2v.yaml"
PUBLISHED = SHIPPED / "Wan2.2-TI2V-5B-Diffusers"
TOKENS = 16
SIZE = {"height": 32, "width": 64, "num_frames": 5}
LATENT_SHAPE = (48, 2, 2, 4)  # 48 channels; (5 - 1) / 4 + 1 frames; 32 / 16 x 64 / 16
TEXTS = ["a red cat on the left", "b", "two big blue squares"]


def _generator(folder: Path, **overrides: object) -> WanGenerator:
    return built_generator(folder, WanGenerator, TOKENS, SIZE, **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_wan22_ti2v_pipeline(tmp_path_factory.mktemp("wan22_ti2v"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> WanGenerator:
    return _generator(folder)


@pytest.fixture(scope="module")
def pipe(folder: Path) -> WanPipeline:
    return WanPipeline.from_pretrained(str(folder))


def _pipeline_timestep(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The timestep ``WanPipeline.__call__`` passes its transformer with ``expand_timesteps``: the first sample's first
    channel of an all-ones mask, every second latent row and column, times ``t``, flattened, one row per sample."""
    mask = torch.ones(latents.shape, dtype=torch.float32)
    return (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)


def _pipeline_velocity(pipe: WanPipeline, latents: torch.Tensor, sigma: float, texts: list[str]) -> torch.Tensor:
    """One unguided step's transformer output as ``WanPipeline.__call__`` computes it at ``t = sigma * 1000``: its own
    ``encode_prompt`` and the expanded timestep."""
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, max_sequence_length=TOKENS)
        timestep = _pipeline_timestep(latents, torch.tensor(sigma * 1000.0))
        return pipe.transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
        )[0]


class _TimestepSpy:
    """Records the ``timestep`` each forward of ``module`` receives."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seen: list[torch.Tensor] = []
        self.handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, _args, kwargs):
        self.seen.append(kwargs["timestep"].detach().clone())

    def __enter__(self) -> _TimestepSpy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


# ------------------------------------------------------------------ the folder
def test_fixture_has_the_published_layout(folder: Path) -> None:
    """The tiny folder names the published components, sets ``expand_timesteps`` and no second expert, carries the
    published scheduler config (UniPC, flow shift 5) and the Wan2.2 VAE's layout keys (48 channels, residual, 2x2
    patchify, 16x / 4x) at a tiny width, and a transformer with 48 channels in and out."""
    index = json.loads((folder / "model_index.json").read_text())
    shipped = json.loads((PUBLISHED / "model_index.json").read_text())
    # transformers 5 has one T5 tokenizer class, T5Tokenizer (T5TokenizerFast is the same class), which
    # save_pretrained names; the published folder was written as T5TokenizerFast.
    assert set(index) - {"_diffusers_version"} == set(shipped)
    for key in set(shipped) - {"tokenizer"}:
        assert index[key] == shipped[key], key
    assert index["expand_timesteps"] is True and index["boundary_ratio"] is None
    ours = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    published = json.loads((PUBLISHED / "scheduler" / "scheduler_config.json").read_text())
    assert {key: ours[key] for key in published} == published and published["flow_shift"] == WAN22_TI2V_FLOW_SHIFT
    vae = json.loads((folder / "vae" / "config.json").read_text())
    real = json.loads((PUBLISHED / "vae" / "config.json").read_text())
    layout = ("z_dim", "is_residual", "in_channels", "out_channels", "patch_size", "temperal_downsample")
    layout += ("scale_factor_spatial", "scale_factor_temporal", "_class_name", "attn_scales")
    assert {key: vae[key] for key in layout} == {key: real[key] for key in layout}
    assert (vae["z_dim"], vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (48, 16, 4)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 48 == len(real["latents_mean"])
    assert len(vae["dim_mult"]) == len(real["dim_mult"]) == 4, "three downsamplings after the 2x2 patchify: 16x"
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    assert (transformer["in_channels"], transformer["out_channels"], transformer["num_layers"]) == (48, 48, 2)
    published_transformer = json.loads((PUBLISHED / "transformer" / "config.json").read_text())
    assert transformer["patch_size"] == [1, 2, 2] == published_transformer["patch_size"]
    assert transformer["num_attention_heads"] * transformer["attention_head_dim"] == 32


def test_latent_shape_and_decode_are_the_pipelines(generator: WanGenerator, pipe: WanPipeline) -> None:
    """Latents at the 16x spatial and 4x temporal factors with 48 channels; ``decode`` is the pipeline's decode
    (``latents / (1 / latents_std) + latents_mean`` over the 48 channels, its VAE, its video postprocessing)."""
    assert generator.expand_timesteps and generator.num_experts == 1 and generator.latent_shape == LATENT_SHAPE
    latents = random_latents(generator.latent_shape, 2, seed=4)
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
    with torch.no_grad():
        video = pipe.vae.decode(latents / inverse_std + mean, return_dict=False)[0]
    expected = pipe.video_processor.postprocess_video(video, output_type="pt")
    got = generator.decode(latents)
    assert got.shape == (2, 5, 3, 32, 64) == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        _ = load_generator(generator.pipeline_path, height=48, width=64, num_frames=5).latent_shape


# ------------------------------------------------------------------ schedule
@pytest.mark.parametrize(("num_steps", "shift"), [(4, None), (7, None), (4, 3.0)])
def test_schedule_is_the_sigmas_of_a_real_pipeline_call(
    folder: Path, pipe: WanPipeline, num_steps: int, shift: float | None
) -> None:
    """The sigmas the pipeline's scheduler holds after a real call at the folder's flow shift 5 and, as the recipe's
    ``rollout.shift`` sets it, at 3 (the shift replaces UniPC's ``flow_shift``); UniPC's first sigma is 1 - 1e-6 in
    float32, the sampler's exactly 1."""
    reference = pipe
    if shift is not None:
        scheduler = UniPCMultistepScheduler.from_pretrained(str(folder), subfolder="scheduler", flow_shift=shift)
        reference = WanPipeline.from_pretrained(str(folder), scheduler=scheduler)
    captured: list[torch.Tensor] = []

    def capture(p, _i, _t, _kwargs):
        captured.append(p.scheduler.sigmas.clone())
        return {}

    reference(
        prompt="a red cat", num_inference_steps=num_steps, guidance_scale=1.0, max_sequence_length=TOKENS,
        output_type="latent", callback_on_step_end=capture, **SIZE,
    )  # fmt: skip
    expected = captured[-1].to(torch.float64)
    ours = load_generator(folder, **SIZE).schedule(num_steps, shift=shift)
    assert ours.sigmas.shape == (num_steps + 1,) and ours.sigmas[0] == 1.0 and abs(float(expected[0]) - 1.0) < 2e-6
    assert torch.equal(ours.sigmas[1:], expected[1:])
    assert ours.details["flow_shift"] == (WAN22_TI2V_FLOW_SHIFT if shift is None else shift)


# ------------------------------------------------------------------ velocity
def test_velocity_is_the_pipelines_transformer_call_with_expanded_timesteps(
    generator: WanGenerator, pipe: WanPipeline
) -> None:
    """``velocity`` equals the pipeline's transformer call (its ``encode_prompt``, its per-token timestep) bit for bit
    at timesteps a UniPC step lands on exactly (750, 500, 250), and the timestep the transformer receives is the
    pipeline's, shape (N, frames x rows / 2 x columns / 2)."""
    latents = random_latents(generator.latent_shape, 3, seed=1)
    cond = generator.encode(TEXTS)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(TEXTS), do_classifier_free_guidance=False, max_sequence_length=TOKENS)
    assert torch.equal(cond["hidden"], embeds), "the pipeline's own encode_prompt"
    tokens = 2 * (2 // 2) * (4 // 2)
    for sigma in (0.75, 0.5, 0.25):
        expected = _pipeline_velocity(pipe, latents, sigma, TEXTS)
        with _TimestepSpy(generator.model) as spy:
            got = generator.velocity(latents, sigma, cond)
        assert torch.equal(got, expected), sigma
        (timestep,) = spy.seen
        assert timestep.shape == (3, tokens) and torch.equal(timestep, _pipeline_timestep(latents, sigma * 1000.0))
    assert expected.abs().mean() > 0.1, "the tiny model predicts something"
    # Per-sample sigmas in one batch: each row is the pipeline's call at its own t.
    sigma = torch.tensor([0.75, 0.25, 0.5])
    mixed = generator.velocity(latents, sigma, cond)
    for row, value in enumerate(sigma.tolist()):
        want = _pipeline_velocity(pipe, latents[row : row + 1], value, TEXTS[row : row + 1])
        torch.testing.assert_close(mixed[row : row + 1], want, rtol=0, atol=1e-6)


def test_a_real_pipeline_call_passes_the_timesteps_velocity_passes(generator: WanGenerator, pipe: WanPipeline) -> None:
    """In a real two-step call the pipeline hands its transformer one timestep per latent token, all equal to the
    step's t; ``velocity`` at ``t / 1000`` hands it the same shape and values and the same output (within the float32
    rounding of ``t / 1000 * 1000``)."""
    latents = random_latents(generator.latent_shape, 2, seed=2)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(_module, _args, kwargs, output):
        calls.append((kwargs["hidden_states"].detach().clone(), kwargs["timestep"].detach().clone(), output[0]))

    handle = pipe.transformer.register_forward_hook(record, with_kwargs=True)
    try:
        pipe(
            prompt=TEXTS[:2], latents=latents.clone(), num_inference_steps=2, guidance_scale=1.0,
            max_sequence_length=TOKENS, output_type="latent", **SIZE,
        )  # fmt: skip
    finally:
        handle.remove()
    assert len(calls) == 2
    cond = generator.encode(TEXTS[:2])
    for hidden, timestep, output in calls:
        t = float(timestep[0, 0])
        assert timestep.shape == (2, 4) and bool((timestep == t).all())
        with _TimestepSpy(generator.model) as spy:
            got = generator.velocity(hidden, t / 1000.0, cond)
        assert spy.seen[0].shape == timestep.shape
        torch.testing.assert_close(spy.seen[0], timestep, rtol=0, atol=1e-3)
        torch.testing.assert_close(got, output, rtol=0, atol=1e-5)


def test_expand_timesteps_off_is_a_different_transformer_call(
    generator: WanGenerator, pipe: WanPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: with ``expand_timesteps`` off the transformer gets one timestep per sample (N,), not the pipeline's
    (N, tokens), so the call the parity above pins is a different one. For text-to-video every token shares the
    step's t, and the tiny transformer's per-sample path then gives the same numbers: the difference is in the call,
    which the timestep comparison catches."""
    latents = random_latents(generator.latent_shape, 2, seed=3)
    cond = generator.encode(TEXTS[:2])
    expected_timestep = _pipeline_timestep(latents, torch.tensor(500.0))
    monkeypatch.setattr(WanGenerator, "expand_timesteps", False)
    with _TimestepSpy(generator.model) as spy:
        mutated = generator.velocity(latents, 0.5, cond)
    (timestep,) = spy.seen
    assert timestep.shape == (2,) != expected_timestep.shape, "the mutation changes what the transformer receives"
    assert torch.equal(mutated, _pipeline_velocity(pipe, latents, 0.5, TEXTS[:2])), "uniform t: same numbers"


# ------------------------------------------------------------------ LoRA
def test_lora_export_loads_through_wan_pipeline(folder: Path, tmp_path: Path) -> None:
    """The recipe's targets (both attentions and the feed-forward layers of each block) get LoRA; the exported file
    changes the pipeline's output through ``WanPipeline.load_lora_weights`` exactly as trained, and the pipeline
    without it is the adapter-disabled reference."""
    targets = [f"attn{a}.{p}" for a in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")]
    targets += ["ffn.net.0.proj", "ffn.net.2"]
    generator = _generator(folder, lora_target_modules=targets)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in generator.model.named_modules() if name.endswith("lora_A")}
    assert adapted == {f"blocks.{block}.{target}" for block in (0, 1) for target in targets}
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in generator.model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))
    latents = random_latents(generator.latent_shape, 2, seed=5)
    cond = generator.encode(TEXTS[:2])
    trained = generator.velocity(latents, 0.5, cond)
    with generator.adapter_disabled():
        reference = generator.velocity(latents, 0.5, cond)
    assert (trained - reference).abs().max() > 1e-4
    generator.save_adapter(str(tmp_path))
    exported = WanPipeline.from_pretrained(str(folder))
    torch.testing.assert_close(_pipeline_velocity(exported, latents, 0.5, TEXTS[:2]), reference, rtol=0, atol=1e-6)
    exported.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(_pipeline_velocity(exported, latents, 0.5, TEXTS[:2]), trained, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the recipe's CPU block
def _header_overrides(folders: dict[str, Path]) -> list[str]:
    """The CPU overrides the recipe's header lists (its ``#   --...`` lines), the tiny folders it names replaced."""
    lines = [line[1:].strip() for line in RECIPE.read_text().splitlines() if line.startswith("#   ")]
    text = " ".join(line for line in lines if line.startswith(("--", "'--")))
    for placeholder in sorted(folders, key=len, reverse=True):
        text = text.replace(placeholder, str(folders[placeholder]))
    return shlex.split(text)


@pytest.mark.integration
def test_recipe_header_cpu_block_trains_two_steps_with_gates_green(tmp_path: Path, folder: Path) -> None:
    refiner = make_qwen2_chat_lm(tmp_path / "qwen")
    overrides = _header_overrides({"/tmp/tiny-wan22-ti2v": folder, "/tmp/tiny-qwen": Path(refiner)})
    assert f"--model.pipeline_path={folder}" in overrides and "--trainer.max_steps=2" in overrides
    outputs = [
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks.dirpath={tmp_path}/ckpt",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_progress_bar=false",
    ]
    cli = main(["fit", "--config", str(RECIPE), *overrides, *outputs])
    generator = cli.model.generator
    assert isinstance(generator, WanGenerator) and generator.expand_timesteps and generator.num_experts == 1
    assert generator.latent_shape == LATENT_SHAPE
    rows = read_metrics(cli)
    assert len(series(rows, "reward/mean")) == 2
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert max(series(rows, "c2/transformer_max_abs_diff")) <= 1e-5
    parity = series(rows, "parity/max_abs_diff")
    assert parity and max(parity) <= 1e-5, "interleave parity ran and is green"
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    assert schedule["sigmas"] == generator.schedule(4, shift=3.0).sigmas.tolist(), "UniPC's at the recipe's shift"
    assert schedule["source"].startswith("UniPCMultistepScheduler(flow_shift=3.0")
    assert cli.model.ledger["transformer"] == 2 * cli.model.losses["transformer"].mini_batches


# ------------------------------------------------------------------ plan
@pytest.mark.slow
def test_plan_builds_the_published_5b_model() -> None:
    """The shipped configs build the published 5B transformer and the plan's fake generator predicts at the recipe's
    256 x 256 x 5 (latents 48 x 2 x 16 x 16) through the same family code, per-token timesteps included."""
    from diffusers import WanTransformer3DModel
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.plan.models import build_generator, meta_model
    from unirl_pl.plan.phases import text_encode
    from unirl_pl.plan.tracker import AllRowsReal

    dit = meta_model(WanTransformer3DModel, PUBLISHED / "transformer", torch.bfloat16)
    assert sum(p.numel() for p in dit.parameters()) == 4_999_787_712
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    generator, _ = build_generator(WanGenerator, {"height": 256, "width": 256, "num_frames": 5}, PUBLISHED, mode)
    assert generator.latent_shape == (48, 2, 16, 16) and generator.expand_timesteps
    with mode, AllRowsReal():
        cond = text_encode(generator, 2)
        latents = torch.empty(2, *generator.latent_shape)
        assert generator.velocity(latents, torch.full((2,), 0.5), cond).shape == latents.shape
