"""Wan2.2's two experts: a ``WanPipeline`` folder with a high-noise ``transformer`` and a low-noise
``transformer_2`` switched at ``boundary_ratio`` loads both, each with its own LoRA; ``velocity`` routes
each row as ``WanPipeline`` does (checked against the pipeline's own denoising loop); the reference
policy, checkpoint trimming and FSDP sharding cover both; the recipe's CPU block trains both experts with
C2 bitwise and exports adapters that ``WanPipeline.load_lora_weights`` loads. Wan2.2-TI2V-5B
(``expand_timesteps``, the 48-channel VAE) is tests/test_wan22_ti2v.py's."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import UniPCMultistepScheduler, WanPipeline
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from tests.chat_lm import make_qwen2_chat_lm
from tests.helpers import ROOT, read_metrics, series
from tests.pipelines import WAN22_BOUNDARY_RATIO, make_wan22_pipeline, random_latents
from unirl_pl.checkpoint import trim_frozen
from unirl_pl.distributed import shard_experts
from unirl_pl.export import main as export_main
from unirl_pl.generators import WanGenerator, load_generator
from unirl_pl.generators.wan import HIGH_NOISE, LOW_NOISE, expert_for_sigma
from unirl_pl.sampling import flow_sigmas

RECIPE = ROOT / "recipes" / "wan22_t2v.yaml"
SIZES = {"height": 16, "width": 16, "num_frames": 5}
TOKENS = 16


def _make(path: Path, **overrides: object) -> WanGenerator:
    kwargs = {"dtype": "float32", "lora_rank": 4, "lora_alpha": 8.0, "max_sequence_length": TOKENS, **SIZES}
    generator = load_generator(path, **{**kwargs, **overrides})
    generator.build()
    return generator


def _perturb(model: torch.nn.Module, seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=rng))


def _lora_b(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if "lora_B" in name]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_wan22_pipeline(tmp_path_factory.mktemp("wan22"))


@pytest.fixture(scope="module")
def generator(folder: Path) -> WanGenerator:
    """A built two-expert generator with zero-init LoRA, shared by the tests that do not change it."""
    return _make(folder)


@pytest.fixture(scope="module")
def inputs(generator: WanGenerator) -> tuple[torch.Tensor, dict]:
    return random_latents(generator.latent_shape, 4, seed=3), generator.encode(["a red cat", "b", "dog", "blue"])


# ------------------------------------------------------------------ routing
def test_expert_for_sigma_switches_at_the_boundary() -> None:
    sigma = torch.tensor([[1.0, 0.9], [0.875, 0.8749]])
    assert expert_for_sigma(sigma, 0.875, 1000).tolist() == [[HIGH_NOISE, HIGH_NOISE], [HIGH_NOISE, LOW_NOISE]]
    assert expert_for_sigma(torch.tensor([0.3, 1.0]), None, 1000).tolist() == [0, 0], "one transformer: always it"
    assert expert_for_sigma(torch.tensor(0.5), 0.4, 1000).item() == HIGH_NOISE


def test_two_expert_folder_loads_both_transformers_each_with_its_lora(generator: WanGenerator) -> None:
    assert generator.num_experts == 2 and generator.boundary_ratio == WAN22_BOUNDARY_RATIO
    assert generator.transformers == [generator.model, generator.model_2]
    assert generator.has_vae and not generator.expand_timesteps and generator.latent_shape == (4, 3, 4, 4)
    trainable = [name for name, p in generator.expert.named_parameters() if p.requires_grad]
    assert all("lora_" in name for name in trainable)
    assert {name.split(".", 1)[0] for name in trainable} == {"model", "model_2"}, "one LoRA per expert"
    assert all(torch.count_nonzero(b) == 0 for b in _lora_b(generator.model) + _lora_b(generator.model_2))
    generator.train()  # both experts follow the mode; the frozen parts stay in eval mode
    try:
        assert generator.model.training and generator.model_2.training and not generator.text_encoder.training
    finally:
        generator.eval()
    assert not generator.model_2.training
    # The two experts are different networks (otherwise the routing tests below prove nothing).
    x, cond = random_latents(generator.latent_shape, 1), generator.encode(["a red cat"])
    high, low = (generator.velocity_of(m, x, 0.5, cond) for m in generator.transformers)
    assert (high - low).abs().max() > 1e-2


def test_velocity_routes_each_row_to_the_expert_its_sigma_selects(generator: WanGenerator, inputs) -> None:
    x, cond = inputs
    high, low = generator.transformers
    # A batch on one side goes whole through that expert; the boundary itself is the high-noise side.
    for sigma, expert in ((0.95, high), (WAN22_BOUNDARY_RATIO, high), (0.8749, low), (0.3, low)):
        assert torch.equal(generator.velocity(x, sigma, cond), generator.velocity_of(expert, x, sigma, cond)), sigma
    # Per-sample sigmas: rows split by expert, each expert runs its rows in order, outputs go back in place.
    sigma = torch.tensor([0.3, 0.95, 0.5, 0.9])
    mixed = generator.velocity(x, sigma, cond)
    assert generator.expert_index(sigma).tolist() == [LOW_NOISE, HIGH_NOISE, LOW_NOISE, HIGH_NOISE]
    for rows, expert in (([1, 3], high), ([0, 2], low)):
        index = torch.tensor(rows)
        want = generator.velocity_of(expert, x[index], sigma[index], {k: v[index] for k, v in cond.items()})
        assert torch.equal(mixed[index], want), "same rows, same expert, same order: bitwise"
    # The gradient of a mixed batch reaches both adapters.
    high_b, low_b = _lora_b(high), _lora_b(low)
    grads = torch.autograd.grad(mixed.square().sum(), high_b + low_b)
    assert any(g.count_nonzero() for g in grads[: len(high_b)]) and any(g.count_nonzero() for g in grads[len(high_b) :])


def test_velocity_matches_wan_pipelines_own_denoising_loop(folder: Path, generator: WanGenerator) -> None:
    """WanPipeline (8 Euler steps of its shift-3 scheduler: sigmas 1, .95, .88 on the high-noise expert,
    .80 ... .009 on the low-noise one) from the same start latents and text states equals the Euler loop
    over ``velocity`` on the pipeline's sigmas."""
    pipe = WanPipeline.from_pretrained(str(folder))
    x = random_latents(generator.latent_shape, 1, seed=5)
    cond = generator.encode(["a red cat on the left"])
    pipe.scheduler.set_timesteps(8)
    sigmas = pipe.scheduler.sigmas.tolist()
    assert generator.expert_index(torch.tensor(sigmas[:-1])).tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    want = pipe(
        prompt_embeds=cond["hidden"],
        guidance_scale=1.0,
        num_inference_steps=8,
        latents=x.clone(),
        output_type="latent",
        **SIZES,
    ).frames
    got = x.clone()
    for s, s_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        got = got + (s_next - s) * generator.velocity(got, s, cond)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ reference, adapters, trimming, sharding
def test_adapter_disabled_bypasses_both_experts_and_adapters_round_trip(folder: Path, inputs, tmp_path) -> None:
    generator = _make(folder, gradient_checkpointing=True)
    assert all(m.is_gradient_checkpointing for m in generator.transformers)
    for seed, model in enumerate(generator.transformers):
        _perturb(model, seed)
    x, cond = inputs
    base = WanPipeline.from_pretrained(str(folder))
    for sigma, frozen in ((0.95, base.transformer), (0.3, base.transformer_2)):
        adapted = generator.velocity(x, sigma, cond)
        with generator.adapter_disabled():
            reference = generator.velocity(x, sigma, cond)
        assert (adapted - reference).abs().max() > 1e-3, sigma
        torch.testing.assert_close(reference, generator.velocity_of(frozen, x, sigma, cond), rtol=0, atol=1e-6)
    assert all(p.requires_grad for m in generator.transformers for n, p in m.named_parameters() if "lora_" in n)

    generator.save_adapter(str(tmp_path / "adapter"))
    fresh = _make(folder)
    fresh.load_adapter(str(tmp_path / "adapter"))
    for sigma in (0.95, 0.3):
        assert torch.equal(fresh.velocity(x, sigma, cond), generator.velocity(x, sigma, cond))
    (tmp_path / "high_only").mkdir()
    (tmp_path / "adapter" / "pytorch_lora_weights.safetensors").rename(tmp_path / "high_only" / "x.safetensors")
    with pytest.raises(ValueError, match="low-noise"):
        fresh.load_adapter(str(tmp_path / "high_only" / "x.safetensors"))


def test_checkpoint_trimming_and_fsdp_sharding_cover_both_experts(generator: WanGenerator, monkeypatch) -> None:
    kept, dropped = trim_frozen(generator.state_dict(), generator)
    assert kept and all("lora_" in key for key in kept)
    assert any(key.startswith("model_2.") for key in kept) and any(key.startswith("model.") for key in kept)
    assert any(key.startswith("model_2.") and "lora_" not in key for key in dropped), "base weights are trimmed"

    sharded: list[torch.nn.Module] = []
    monkeypatch.setattr("torch.distributed.fsdp.fully_shard", lambda module, **kwargs: sharded.append(module))
    shard_experts({"transformer": generator}, ["transformer"], mesh=None, reshard_after_forward=True)
    for model in generator.transformers:
        assert any(m is model for m in sharded), "each expert's root is sharded"
        assert all(any(m is block for m in sharded) for block in model.blocks), "and each of its blocks"


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"transformer_2": ["diffusers", "WanTransformer3DModel"]}, "transformer_2 but no boundary_ratio"),
        ({"boundary_ratio": 0.875}, "boundary_ratio 0.875 but no transformer_2"),
        ({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 1.5}, "must be in"),
    ],
)
def test_inconsistent_two_expert_index_is_refused(tmp_path: Path, index: dict, message: str) -> None:
    full = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"], **index}
    (tmp_path / "model_index.json").write_text(json.dumps(full))
    with pytest.raises(ValueError, match=message):
        load_generator(tmp_path).build()


# ------------------------------------------------------------------ the recipe
def _recipe_cpu_block() -> list[str]:
    """The overrides the recipe's header documents for a CPU run, exactly as written there."""
    lines = RECIPE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("add:")) + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("#   --"):
            break
        block += shlex.split(line[1:])
    return block


def test_recipe_window_trains_both_experts_at_real_size() -> None:
    """At the recipe's own steps, shift and window, Wan2.2-T2V-A14B's boundary puts SDE steps on both sides."""
    model = yaml.safe_load(RECIPE.read_text())["model"]["init_args"]
    rollout = model["rollout"]
    sigmas = flow_sigmas(rollout["num_steps"], rollout["shift"])
    start, end = model["generator_algorithm"]["init_args"]["sde_window"]
    experts = expert_for_sigma(sigmas[start:end], 0.875, 1000).tolist()
    assert experts.count(HIGH_NOISE) >= 2 and experts.count(LOW_NOISE) >= 2, experts


@pytest.mark.integration
def test_recipe_cpu_block_trains_both_experts_and_exports_for_wan_pipeline(tmp_path: Path, monkeypatch) -> None:
    # The real folder's scheduler (UniPC on flow sigmas), as `python -m tests.pipelines wan22` builds it.
    tiny = make_wan22_pipeline(tmp_path / "tiny-wan22", unipc=True)
    assert json.loads((tiny / "model_index.json").read_text())["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    qwen = make_qwen2_chat_lm(tmp_path / "tiny-qwen")
    block = [
        arg.replace("/tmp/tiny-wan22", str(tiny)).replace("/tmp/tiny-qwen", str(qwen)) for arg in _recipe_cpu_block()
    ]
    assert "--trainer.max_steps=2" in block and f"--model.pipeline_path={tiny}" in block
    monkeypatch.chdir(tmp_path)  # the recipe's runs/ folders land here
    from unirl_pl.cli import main

    out = tmp_path / "adapters"
    extra = ["--trainer.callbacks+=unirl_pl.callbacks.AdapterExport", f"--trainer.callbacks.output_dir={out}"]
    cli = main(["fit", "--config", str(RECIPE), *block, *extra])

    rows = read_metrics(cli)
    assert series(rows, "c2/transformer_max_abs_diff") == [0.0, 0.0], "both experts' recompute is bitwise"
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert series(rows, "parity/transformer_max_abs_diff") == [0.0]
    module, generator = cli.model, cli.model.generator
    updates = module.losses["transformer"].mini_batches  # the recipe's updates per rollout
    assert module.ledger["transformer"] == 2 * updates, "one weight version for both experts, one per update"
    # The block's window [2, 4) of 4 steps at the recipe's shift 12 spans the boundary: the shift replaces
    # UniPC's flow_shift, sigmas 1, .973, .923, .8006, 0 (schedule.json lists them).
    assert "--model.generator_algorithm.init_args.sde_window=[2,4]" in block and "--model.rollout.num_steps=4" in block
    sigmas = module.diffusion_denoise.sigmas(4)
    shift = module.rollout_config.shift
    reference = UniPCMultistepScheduler.from_pretrained(tiny, subfolder="scheduler", flow_shift=shift)
    reference.set_timesteps(4)  # its first sigma is 1 - 1e-6 in float32; the sampler starts at exactly 1
    assert sigmas[0] == 1.0 and torch.equal(sigmas[1:], reference.sigmas[1:].to(torch.float64))
    assert abs(float(sigmas[3]) - 0.8006) < 1e-4 and abs(float(flow_sigmas(4, shift)[3]) - 0.8) < 1e-12
    on_disk = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    assert on_disk["sigmas"] == sigmas.tolist()
    assert on_disk["source"].startswith("UniPCMultistepScheduler(flow_shift=12.0")
    assert generator.expert_index(sigmas[2:4]).tolist() == [HIGH_NOISE, LOW_NOISE]
    for model in generator.transformers:
        assert any(torch.count_nonzero(b) > 0 for b in _lora_b(model)), "each expert's LoRA was trained"

    pipe = WanPipeline.from_pretrained(str(tiny))
    pipe.load_lora_weights(str(out / "transformer"))
    pipe.load_lora_weights(str(out / "transformer" / "transformer_2"), load_into_transformer_2=True)
    for loaded, trained in zip((pipe.transformer, pipe.transformer_2), generator.transformers, strict=True):
        got = get_peft_model_state_dict(loaded, adapter_name=loaded.active_adapters()[0])
        want = get_peft_model_state_dict(trained)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key], want[key]) for key in want)
    # The export command from the checkpoint (frozen base weights of both experts trimmed, refilled on load)
    # writes the same two adapters: with --raw, the training weights AdapterExport wrote (without it, the
    # recipe's EMA, which at every 8 steps has not moved off the initial adapters in 2 steps).
    (ckpt,) = (Path(cli.trainer.log_dir) / "checkpoints").glob("last*.ckpt")  # the run's own folder
    again = tmp_path / "from_ckpt"
    config = str(Path(cli.trainer.log_dir) / "config.yaml")
    export_main(["--config", config, "--ckpt", str(ckpt), "--out", str(again), "--raw"])
    for sub in ("transformer", "transformer/transformer_2"):
        want, got = (load_file(str(d / sub / "pytorch_lora_weights.safetensors")) for d in (out, again))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), sub
    x, cond = random_latents(generator.latent_shape, 2), generator.encode(["a red cat", "b"])
    for sigma, loaded in ((0.95, pipe.transformer), (0.3, pipe.transformer_2)):
        torch.testing.assert_close(
            generator.velocity_of(loaded, x, sigma, cond), generator.velocity(x, sigma, cond), rtol=0, atol=1e-6
        )
