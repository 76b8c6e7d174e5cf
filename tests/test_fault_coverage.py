"""Six faults the suite once let through (issue 21, item 9), each pinned by a test that fails on it.

Every test names its fault. Each was injected into the code one at a time and seen to fail the test
(the report of issue 21 lists where and how). The module-level tests share one module built from
``recipes/tiny.yaml``; weights and patched settings are put back after each test.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from diffusers import FluxPipeline

from tests.helpers import ROOT, TINY, read_metrics, run_cli, run_cli_subprocess, series
from tests.pipelines import make_flux_pipeline, random_latents
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.generators import load_generator
from unirl_pl.method.advantages import AdvantageConfig, GroupLayout, compute_advantages
from unirl_pl.method.update import PolicyUpdate
from unirl_pl.records import Experience
from unirl_pl.seeding import STREAM_LM, counter_uniform, gumbel_argmax, sample_keys

NAN = float("nan")
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
PROMPTS = ["a red circle", "a blue square"]
REQUEST_IDS = [3, 7]
FAST = (
    "--trainer.limit_val_batches=0",
    "--trainer.enable_checkpointing=false",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)


@pytest.fixture(scope="module")
def built():
    cli = main(["--config", TINY, *QUIET], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


@pytest.fixture
def model(built, monkeypatch):
    """The shared module; its trainable weights are put back (gradients cleared) after the test.

    Outside a trainer ``manual_backward`` (which the DiT loss calls per denoising step) is a plain
    ``backward``, as Lightning's full-precision plugin runs it.
    """
    module, _ = built
    monkeypatch.setattr(module, "manual_backward", lambda loss, *args, **kwargs: loss.backward(*args, **kwargs))
    saved = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    yield module
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n in saved:
                p.copy_(saved[n])
                p.grad = None


def collect(model, dm, layout: GroupLayout | None = None) -> Experience:
    """One step's rollout of PROMPTS (2 prompts x K samples) with the data module's seed."""
    batch = PromptBatch(list(PROMPTS), list(REQUEST_IDS), seed=dm.seed, layout=layout or dm.layout)
    return model.source.collect(batch, model.device)


# ------------------------------------------------------------------ 1. DiT advantages per micro-batch


def _dit_gradient(model, exp: Experience) -> tuple[torch.Tensor, float]:
    """The flat gradient of the DiT's loss on ``exp`` over its LoRA parameters, and its policy-gradient term."""
    params = [p for p in model.experts()["transformer"].parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    out = model._loss("transformer", exp)
    if not out.backpropagated:
        out.loss.backward()
    grads = torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in params])
    return grads, float(out.pg_loss)


def test_micro_batched_dit_gradient_equals_the_one_batch_gradient(model, built, monkeypatch):
    """Fault: every micro-batch of the DiT loss reads the first micro-batch's advantages.

    8 samples in micro-batches of 2 must give the gradient of one batch of 8: each chunk's terms use
    the advantages of its own rows. With unchanged weights every ratio is 1 (the recompute of a chunk
    is bitwise its rollout), so the policy-gradient term is also ``-mean(advantages)`` up to rounding.
    """
    _, dm = built
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at 0: give it noise so that A's gradients are not 0 either
        for name, p in model.experts()["transformer"].named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    loop = model.diffusion_denoise
    assert model.source.diffusion_denoise is loop
    monkeypatch.setattr(loop, "config", replace(loop.config, micro_batch_size=2))
    exp = collect(model, dm)
    record = exp.records["diffusion_denoise"]
    assert record is not None and record.chunks == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Distinct per row, and every chunk's mean differs from the first chunk's.
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.0, -0.75, 2.0, 0.5, -1.25])
    exp = replace(exp, advantages={**exp.advantages, "diffusion_denoise": advantages})
    chunked, pg_chunked = _dit_gradient(model, exp)
    one_batch = replace(exp, records={**exp.records, "diffusion_denoise": replace(record, chunks=[(0, 8)])})
    whole, pg_whole = _dit_gradient(model, one_batch)
    assert pg_chunked == pytest.approx(-float(advantages.mean()), abs=1e-6), "each row's own advantage"
    assert pg_whole == pytest.approx(-float(advantages.mean()), abs=1e-6)
    scale = float(whole.abs().max())
    assert scale > 0 and bool((whole != 0).float().mean() > 0.5), "power: the gradient reaches A and B"
    # The one-batch recompute differs from the chunked one only by batch-variant kernels (~1e-7 relative).
    diff = float((chunked - whole).abs().max())
    assert diff <= 1e-5 * scale, f"micro-batched gradient differs from one-batch by {diff:.3g} (scale {scale:.3g})"


# ------------------------------------------------------------------------- 2. FLUX, non-square


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    path = make_flux_pipeline(tmp_path_factory.mktemp("flux"))
    size = {"height": 32, "width": 64}
    generator = load_generator(path, dtype="float32", lora_rank=4, lora_alpha=8.0, max_sequence_length=16, **size)
    generator.build()
    return generator, FluxPipeline.from_pretrained(str(path)), size


def test_flux_velocity_on_a_non_square_image_is_the_pipelines_own(flux):
    """Fault: FLUX latents unpacked (or their image ids built) with height and width swapped.

    A square image cannot tell the two apart; a 32x64 one can. The reference is FluxPipeline's own
    pack -> transformer -> unpack (its ``__call__``'s calls, in pixel sizes and its VAE factor) with the
    pipeline's transformer, which the adapter-disabled generator must equal.
    """
    generator, pipe, size = flux
    height, width = size["height"], size["width"]
    factor = pipe.vae_scale_factor
    assert generator.latent_shape == (4, height // factor, width // factor) == (4, 16, 32)
    latents = random_latents(generator.latent_shape, 2, seed=1)
    sigma = torch.tensor([0.3, 0.8])
    cond = generator.encode(["a red cat on the left", "two big blue squares"])
    with torch.no_grad(), generator.adapter_disabled():
        ours = generator.velocity(latents, sigma, cond)
        b, c, h, w = latents.shape
        packed = pipe._pack_latents(latents, b, c, h, w)
        img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        out = pipe.transformer(
            hidden_states=packed,
            timestep=sigma,  # the pipeline passes timesteps / 1000, i.e. sigma
            guidance=torch.full((b,), generator.guidance_scale),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["hidden"],
            txt_ids=torch.zeros(cond["hidden"].shape[1], 3),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        reference = pipe._unpack_latents(out, height, width, factor)
    assert ours.shape == reference.shape == latents.shape
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    # Power: the transposed layout is a different field, not a rounding away.
    transposed = pipe._unpack_latents(out, width, height, factor).reshape(latents.shape)
    assert float((transposed - reference).abs().max()) > 1e-2
    assert generator.decode(latents).shape == (2, 3, height, width)


# --------------------------------------------------------------------- 3. the refiner's sample keys


def test_the_samples_of_one_request_draw_different_tokens(model):
    """Fault: the refiner's counter-based keys ignore the sample index, so K samples of a request are one.

    8 samples of one request at temperature 1 on the random tiny LM (nearly uniform over its vocabulary):
    all identical has probability ~0 unless the samples share their noise.
    """
    loop = model.ar_decode
    assert loop.config.temperature == 1.0 and loop.config.top_k is None
    k = 8
    _, record = loop.sample([PROMPTS[0]] * k, [5] * k, list(range(k)), "rollout", seed=0)
    first = record.gen_ids[:, 0].tolist()
    rows = {tuple(row.tolist()) for row in record.gen_ids}
    assert len(set(first)) >= k // 2 and len(rows) == k, f"first tokens {first}"
    # Still keyed by the sample, not the batch: sample 5 alone draws the same tokens.
    _, alone = loop.sample([PROMPTS[0]], [5], [5], "rollout", seed=0)
    assert torch.equal(alone.gen_ids[0], record.gen_ids[5])


def test_token_noise_differs_across_the_sample_index():
    """Fault: as above, at the key: (seed, request, sample) must give each sample its own noise."""
    k = 8
    keys = sample_keys(11, [5] * k, list(range(k)), STREAM_LM)
    assert len(set(keys.tolist())) == k
    noise = counter_uniform(keys, position=3, size=64)
    assert all(not torch.equal(noise[i], noise[j]) for i in range(k) for j in range(i))
    # The stream is part of the key too (the LM's tokens and the DiT's noise are independent).
    assert not torch.equal(keys, sample_keys(11, [5] * k, list(range(k)), STREAM_LM + 1))


def test_gumbel_max_over_the_samples_of_one_request_follows_the_softmax():
    """Fault: as above; and the Gumbel-max draw must be a draw from ``softmax(logits)``.

    20,000 samples of one request (sample indices 0..n-1) at one position, and 4,000 positions of one
    sample: Pearson's chi-square over 8 categories (7 degrees of freedom) must stay below 40.5, its
    1e-6 upper quantile. The draws are a pure function of the seed, so this cannot flake.
    """
    n = 20_000
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0, -3.0, 0.2, 0.7])

    def chi_square(tokens: torch.Tensor) -> float:
        expected = logits.double().softmax(-1) * len(tokens)
        observed = torch.bincount(tokens, minlength=len(logits)).double()
        return float(((observed - expected) ** 2 / expected).sum())

    over_samples = gumbel_argmax(logits.expand(n, -1), sample_keys(0, [5] * n, list(range(n)), STREAM_LM), 3)
    key = sample_keys(0, [5], [2], STREAM_LM)
    over_positions = torch.cat([gumbel_argmax(logits[None], key, t) for t in range(n // 5)])
    for name, tokens in (("sample indices", over_samples), ("positions", over_positions)):
        stat = chi_square(tokens)
        assert stat < 40.5, f"chi-square over {name}: {stat:.1f} (df 7)"


# ------------------------------------------------------ 4. finite loss, non-finite gradient norm


class PoisonGradient(pl.Callback):
    """After every backward of RL step ``step`` on rank ``rank``, the first of ``expert``'s LoRA gradients
    that exists becomes +inf (the loss stays finite). After every step it snapshots the trainable weights,
    the optimizers' step counts, the skip count, the versions and whether this rank's gradients of
    ``expert`` were finite after its last backward (to ``out_dir`` when given: one file per rank and step,
    for multi-process runs)."""

    def __init__(self, expert: str = "transformer", step: int = 1, rank: int = 0, out_dir: str | None = None):
        self.expert, self.step, self.rank, self.out_dir = expert, step, rank, out_dir
        self.taken: list[dict] = []
        self.poisoned = 0
        self.finite: bool | None = None

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step != self.step:
            return
        grads = [p.grad for p in pl_module.experts()[self.expert].parameters() if p.grad is not None]
        if grads and trainer.global_rank == self.rank:
            grads[0].fill_(math.inf)
            self.poisoned += 1
        # Whether this rank's gradients are finite after its latest backward (the one before the skip check).
        self.finite = all(bool(torch.isfinite(g).all()) for g in grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        snapshot = {
            "weights": {k: v.detach().clone() for k, v in pl_module.named_parameters() if v.requires_grad},
            "opt_steps": [int(s["step"]) for opt in trainer.optimizers for s in opt.state.values() if "step" in s],
            "skipped": pl_module.skipped_steps,
            "versions": pl_module.ledger.as_dict(),
            "poisoned": self.poisoned,
            "finite": self.finite,
        }
        self.taken.append(snapshot)
        if self.out_dir is not None:
            torch.save(snapshot, Path(self.out_dir) / f"rank{trainer.global_rank}_step{batch_idx}.pt")


def _poisoner(cli) -> PoisonGradient:
    return next(c for c in cli.trainer.callbacks if type(c).__name__ == "PoisonGradient")


@pytest.mark.slow
def test_a_finite_loss_with_a_non_finite_gradient_skips_the_step(tmp_path):
    """Fault: only the losses are checked, so a finite loss with an infinite gradient norm is applied."""
    cli = run_cli(
        tmp_path, "--trainer.max_steps=2", *FAST, "--trainer.callbacks+=tests.test_fault_coverage.PoisonGradient"
    )
    before, skipped = _poisoner(cli).taken
    assert skipped["poisoned"] > 0 and skipped["finite"] is False, "the poison reached the gradient"
    assert all(bool(torch.isfinite(v).all()) for v in skipped["weights"].values()), "an infinite gradient was applied"
    assert all(torch.equal(before["weights"][k], skipped["weights"][k]) for k in before["weights"]), "weights moved"
    assert before["opt_steps"] == skipped["opt_steps"], "the optimizer state advanced"
    assert skipped["versions"]["transformer"] == skipped["versions"]["llm"] == 1, "a version was bumped"
    assert series(read_metrics(cli), "train/skipped_steps") == [0.0, 1.0]


# ------------------------------------------------------------- 5. nonfinite_rewards: drop, by group


def _advantage(rewards: list[float], group_size: int) -> list[float]:
    """By hand: a dropped (NaN) reward sits at the mean of the rest of its group, so it adds nothing to
    the squared deviations; the std is the population std over the whole group (all dropped: all 0)."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        kept = [r for r in group if not math.isnan(r)]
        mean = sum(kept) / max(len(kept), 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in kept) / len(group))
        out += [0.0 if math.isnan(r) else (r - mean) / (std + 1e-4) for r in group]
    return out


def _compute(rewards: list[float], layout: GroupLayout, scheme: str = "shared"):
    p = len(rewards) // (layout.samples_per_prompt * layout.images_per_refinement)
    config = AdvantageConfig(scheme=scheme)
    return compute_advantages(torch.tensor(rewards), layout, p, config, lambda r: None, drop_nonfinite=True)


def test_drop_puts_a_dropped_sample_at_its_prompt_groups_mean():
    """Fault: ``drop`` fills a bad reward by its text sample instead of its prompt group (with one image
    per text that group holds only the bad sample: it is filled with 0 and gets a non-zero advantage)."""
    rewards = [0.1, 0.7, NAN, 0.4, 0.2, 0.9, 0.5, 0.3]
    text_rewards, text_adv, image_adv, dropped = _compute(rewards, GroupLayout(4, 1, 1))
    assert dropped.tolist() == [False, False, True, False, False, False, False, False]
    assert text_adv[2] == 0.0 and image_adv[2] == 0.0
    assert text_adv.tolist() == pytest.approx(_advantage(rewards, 4), abs=1e-6)
    assert text_rewards[2] == pytest.approx(0.4)


def test_drop_with_several_images_per_text_gives_the_dropped_image_advantage_zero():
    """Same fault, M = 2 images per text. ``shared``: the DiT's group is the prompt; ``hierarchical``: it is
    the text (its M images), and a text whose every image was dropped sits at its prompt's mean for the LM.
    A text's reward is the mean of its images that were kept."""
    layout = GroupLayout(samples_per_prompt=3, num_skip_refinement=0, images_per_refinement=2)
    rewards = [0.1, NAN, 0.5, 0.9, 0.3, 0.7]
    text_rewards, text_adv, image_adv, _ = _compute(rewards, layout, "shared")
    assert text_rewards.tolist() == pytest.approx([0.1, 0.7, 0.5])
    assert image_adv.tolist() == pytest.approx(_advantage(rewards, 6), abs=1e-6) and image_adv[1] == 0.0
    assert text_adv.tolist() == pytest.approx(_advantage([0.1, 0.7, 0.5], 3), abs=1e-6)

    rewards = [0.1, NAN, 0.5, 0.9, NAN, NAN, 0.2, 0.6]
    layout = GroupLayout(samples_per_prompt=4, num_skip_refinement=0, images_per_refinement=2)
    text_rewards, text_adv, image_adv, _ = _compute(rewards, layout, "hierarchical")
    assert image_adv.tolist() == pytest.approx(_advantage(rewards, 2), abs=1e-6)
    assert image_adv[1] == image_adv[4] == image_adv[5] == 0.0 and abs(float(image_adv[2])) > 0.9
    kept_means = [0.1, 0.7, NAN, 0.4]  # text 2 has no image left: the LM sees it at its prompt's mean
    assert text_adv.tolist() == pytest.approx(_advantage(kept_means, 4), abs=1e-6) and text_adv[2] == 0.0
    assert text_rewards.tolist() == pytest.approx([0.1, 0.7, 0.4, 0.4])


def _with_rewards(monkeypatch, model, values: list[float], scheme: str = "shared") -> None:
    """The experience source scores with ``values`` (in sample order) and drops non-finite ones."""

    def reward(prompts, refined, images, **keywords):  # stands in for the WeightedSum, which takes replies
        assert len(prompts) == len(values)
        total = torch.tensor(values)
        return total, {"fixed": total}

    monkeypatch.setattr(model.source, "reward", reward)
    monkeypatch.setattr(model.source, "drop_nonfinite", True)
    monkeypatch.setattr(model.source, "advantages", AdvantageConfig(scheme=scheme))


def test_drop_in_the_experience_gives_both_experts_advantage_zero(model, built, monkeypatch):
    """Same fault, through the experience source: the dropped sample is a refined one, so both the LM's
    and the DiT's advantage of it are 0 and its group's others are those of the kept rewards."""
    _, dm = built
    rewards = [0.1, 0.7, NAN, 0.4, 0.2, 0.9, 0.5, 0.3]
    _with_rewards(monkeypatch, model, rewards)
    exp = collect(model, dm, GroupLayout(4, 1, 1))
    assert exp.dropped == 1 and math.isnan(float(exp.rewards[2]))
    expected = _advantage(rewards, 4)
    assert exp.advantages["diffusion_denoise"].tolist() == pytest.approx(expected, abs=1e-6)
    assert exp.lm is not None and exp.lm.rows.tolist() == [1, 2, 3, 5, 6, 7]
    assert exp.advantages["ar_decode"].tolist() == pytest.approx([expected[i] for i in (1, 2, 3, 5, 6, 7)], abs=1e-6)
    assert exp.advantages["ar_decode"][1] == 0.0 and exp.advantages["diffusion_denoise"][2] == 0.0

    rewards = [0.1, NAN, 0.5, 0.9, 0.3, 0.7, 0.2, 0.6] * 2
    _with_rewards(monkeypatch, model, rewards)
    exp = collect(model, dm, GroupLayout(4, 1, 2))
    assert exp.advantages["diffusion_denoise"].tolist() == pytest.approx(_advantage(rewards, 8), abs=1e-6)
    assert exp.text_rewards[0] == pytest.approx(0.1), "a text's reward is the mean of its kept images"
    _with_rewards(monkeypatch, model, rewards, "hierarchical")
    exp = collect(model, dm, GroupLayout(4, 1, 2))
    assert exp.advantages["diffusion_denoise"].tolist() == pytest.approx(_advantage(rewards, 2), abs=1e-6)
    assert exp.advantages["diffusion_denoise"][1] == 0.0 and exp.advantages["diffusion_denoise"][9] == 0.0


# ----------------------------------------------------------------- 6. the skip decision, all ranks


def test_a_non_finite_value_on_another_rank_skips_this_one(model, monkeypatch):
    """Fault: the skip decision is taken per rank, so a rank whose values are finite steps while another skips.

    Here the other rank is a stand-in for the all-reduce: it reports a non-finite value (1) whatever this
    rank says; this rank's loss and gradient norm are finite and it must still decide to skip.
    """
    module = importlib.import_module(PolicyUpdate.__module__)
    seen: list[int] = []

    def other_rank_bad(value: int, device=None) -> int:
        seen.append(value)
        return 1

    monkeypatch.setattr(module, "agree_max", other_rank_bad)
    finite = {"transformer": SimpleNamespace(loss=torch.tensor(0.5))}
    assert not PolicyUpdate(model).all_finite(finite, {"transformer": torch.tensor(1.0)})
    assert seen == [0], "this rank's own values are finite"
    monkeypatch.setattr(module, "agree_max", lambda value, device=None: value)
    assert PolicyUpdate(model).all_finite(finite, {"transformer": torch.tensor(1.0)})
    assert not PolicyUpdate(model).all_finite(finite, {"transformer": torch.tensor(math.inf)})


@pytest.mark.integration
def test_two_ranks_skip_together_when_one_ranks_gradient_is_not_finite(tmp_path):
    """Same fault, on 2 DDP processes (gloo): rank 0's LM gradient is +inf after its last backward of step 1
    (after DDP's all-reduce, so rank 1's gradients stay finite). Both ranks must skip."""
    out = tmp_path / "snapshots"
    out.mkdir()
    args = {"expert": "llm", "step": 1, "rank": 0, "out_dir": str(out)}
    poison = json.dumps({"class_path": "tests.test_fault_coverage.PoisonGradient", "init_args": args})
    run_cli_subprocess(
        "fit", "--config", TINY, "--config", str(ROOT / "recipes" / "ddp.yaml"), *FAST,
        "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck]",
        f"--trainer.callbacks+={poison}",
        timeout=300,
    )  # fmt: skip
    snaps = {(r, s): torch.load(out / f"rank{r}_step{s}.pt", weights_only=True) for r in (0, 1) for s in (0, 1)}
    assert snaps[0, 1]["poisoned"] > 0 and snaps[1, 1]["poisoned"] == 0
    # Power: no later backward all-reduced the poison into rank 1, so only rank 0 saw it.
    assert snaps[0, 1]["finite"] is False and snaps[1, 1]["finite"] is True
    for rank in (0, 1):
        before, after = snaps[rank, 0], snaps[rank, 1]
        assert after["skipped"] == 1, f"rank {rank} did not skip"
        assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"]), rank
        assert after["versions"] == before["versions"], rank
    weights = [snaps[r, 1]["weights"] for r in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "the ranks' weights differ"
