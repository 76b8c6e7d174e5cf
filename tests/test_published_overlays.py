"""The published-setting overlays (``recipes/algorithms/*_published.yaml``) and the refused combinations.

Each published overlay applied to the main recipe parses and gives the reference's values row for row (the
overlay's header names the reference file and commit of each); the windows they describe are the
reference's (Flow-GRPO trains ``[0, int(0.99 N))`` with the SDE, Flow-GRPO-Fast places its CPS windows in
``[0, N // 2)``, MixGRPO never trains step ``N - 2``); DiffusionNFT refuses a shared start noise, CPS refuses
GRPO-Guard; DAPO's overlong penalty is checked by hand at its three regimes and reaches the refiner's
advantages only. Fast: each overlay is parsed once (no experts built), two tests build the tiny recipe.
"""

from __future__ import annotations

import re
from functools import cache
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import JOINT, ROOT, TINY
from unirl_pl.algorithms import DAPO, GSPO, DiffusionNFT, FlowCPS, FlowGRPO, FlowGRPOFast, MixGRPO
from unirl_pl.algorithms.token_grpo import overlong_penalty
from unirl_pl.cli import main
from unirl_pl.data import PromptBatch
from unirl_pl.group_stats import group_advantages
from unirl_pl.loops import RolloutConfig
from unirl_pl.method.advantages import compute_advantages

OVERLAYS = ROOT / "recipes" / "algorithms"
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]"]
PUBLISHED = (
    "flow_grpo_published",
    "flow_grpo_fast_published",
    "diffusion_nft_published",
    "dapo_published",
    "gspo_published",
)


@cache
def parsed(name: str):
    """The module of ``recipes/joint.yaml`` + the overlay, parsed (experts not built)."""
    return main(["--config", JOINT, "--config", str(OVERLAYS / f"{name}.yaml"), *QUIET], run=False).model


def tiny(*overrides: str):
    """The tiny recipe with experts built (a 4-step schedule unless overridden)."""
    cli = main(["--config", TINY, *QUIET, "--trainer.enable_progress_bar=false", *overrides], run=False)
    cli.model.configure_model()
    return cli.model, cli.datamodule


def collect(model, dm, prompts=("a red circle", "a blue square"), request_ids=(3, 7)):
    batch = PromptBatch(list(prompts), list(request_ids), seed=dm.seed, layout=dm.layout)
    return model.source.collect(batch, model.device)


# ------------------------------------------------------------------ every published overlay


def test_every_published_overlay_is_checked_here_and_names_its_sources():
    assert {p.stem for p in OVERLAYS.glob("*_published.yaml")} == set(PUBLISHED)
    for name in PUBLISHED:
        text = (OVERLAYS / f"{name}.yaml").read_text()
        first = text.splitlines()[0]
        assert first == f"# python -m unirl_pl fit --config recipes/joint.yaml --config recipes/algorithms/{name}.yaml"
        assert re.search(r"github\.com/[\w.-]+/[\w.-]+", text) and re.search(r"commit [0-9a-f]{12}", text), name


# ------------------------------------------------------------------ Flow-GRPO


def test_flow_grpo_published_values():
    model = parsed("flow_grpo_published")
    algo = model.generator_algorithm
    assert type(algo) is FlowGRPO, "the SDE step, not the recipe's CPS"
    assert algo.timestep_fraction == 0.99 and algo.sde_window is None
    assert algo.level == 0.7 and algo.guard is False
    assert model.losses["transformer"].clip_eps == 1e-4 and model.losses["transformer"].beta == 0.04
    assert model.rollout_config.shared_start_noise is False and model.rollout_config.num_steps == 10
    # The recipe's refiner is untouched.
    assert model.losses["llm"].clip_eps == 0.2 and model.losses["llm"].beta == 0.01


@pytest.mark.parametrize("num_steps", [1, 4, 8, 10, 25, 40, 100])
def test_flow_grpo_timestep_fraction_trains_the_first_int_fraction_steps_with_the_sde(num_steps):
    algo = parsed("flow_grpo_published").generator_algorithm
    config = RolloutConfig(num_steps=num_steps)
    trained = int(0.99 * num_steps)
    if trained == 0:
        with pytest.raises(ValueError, match="timestep_fraction"):
            algo.window(config)
        return
    plan = algo.plan(config, 0, [1, 2, 3], [0, 1, 2])
    assert plan.starts == (0, 0, 0) and plan.size == trained and plan.kind == "sde" and plan.noise_level == 0.7
    assert algo.describe(config)["sde_steps"] == list(range(trained))
    assert algo.least_steps(config) == min(trained + 1, num_steps), "a shorter request keeps a step after the window"


def test_flow_grpo_published_rollout_records_the_sde_on_steps_0_to_int_099_n():
    model, dm = tiny("--config", str(OVERLAYS / "flow_grpo_published.yaml"))  # tiny: 8 steps -> [0, 7)
    record = collect(model, dm).records["diffusion_denoise"]
    assert record.kind == "sde" and record.noise_level == 0.7 and record.num_steps == int(0.99 * 8) == 7
    assert set(record.starts.tolist()) == {0}


def test_flow_grpo_window_is_one_of_sde_window_or_timestep_fraction():
    assert FlowGRPO().window(RolloutConfig(num_steps=10)) == (0, 3), "the default window is unchanged"
    assert FlowGRPO(sde_window=(1, 4)).window(RolloutConfig(num_steps=10)) == (1, 4)
    with pytest.raises(ValueError, match="both set the window"):
        FlowGRPO(sde_window=(0, 4), timestep_fraction=0.99)
    with pytest.raises(ValueError, match="timestep_fraction must be in"):
        FlowGRPO(timestep_fraction=1.5)
    # CPS takes the fraction too, and still refuses a window reaching its deterministic last step.
    assert FlowCPS(timestep_fraction=0.99).window(RolloutConfig(num_steps=10)) == (0, 9)
    with pytest.raises(ValueError, match="includes the last step"):
        FlowCPS(timestep_fraction=1.0).window(RolloutConfig(num_steps=10))


# ------------------------------------------------------------------ Flow-GRPO-Fast


def test_flow_grpo_fast_published_values():
    model = parsed("flow_grpo_fast_published")
    algo = model.generator_algorithm
    assert type(algo) is FlowGRPOFast
    assert algo.window_size == 3 and algo.window_fraction == 0.5 and algo.window_range is None
    assert algo.kind == "cps" and algo.level == 0.8 and algo.guard is False
    assert model.losses["transformer"].clip_eps == 1e-5 and model.losses["transformer"].beta == 0.0
    assert model.rollout_config.shared_start_noise is False


@pytest.mark.parametrize("num_steps", [6, 7, 10, 25, 40])
def test_flow_grpo_fast_published_windows_lie_in_the_first_half(num_steps):
    algo = parsed("flow_grpo_fast_published").generator_algorithm
    config = RolloutConfig(num_steps=num_steps)
    assert algo.span(config) == (0, num_steps // 2)
    ids, idx = [r for r in range(16) for _ in range(8)], list(range(8)) * 16
    starts = algo.starts(config, 0, ids, idx)
    assert all(0 <= s and s + 3 <= num_steps // 2 for s in starts), starts
    assert set(starts) == set(range(num_steps // 2 - 3 + 1)), "every position of the range is drawn"
    plan = algo.plan(config, 0, ids, idx)
    assert plan.kind == "cps" and plan.size == 3 and plan.noise_level == 0.8
    assert algo.describe(config)["sde_steps"] == list(range(num_steps // 2))


def test_flow_grpo_fast_tuned_overlay_keeps_its_range_and_step():
    algo = FlowGRPOFast(window_size=2, window_range=None, noise_level=0.7)  # recipes/algorithms/flow_grpo_fast.yaml
    assert algo.span(RolloutConfig(num_steps=10)) == (0, 9) and algo.kind == "sde" and FlowGRPOFast.kind == "sde"
    with pytest.raises(ValueError, match="both set the window"):
        FlowGRPOFast(window_range=(0, 5), window_fraction=0.5)
    with pytest.raises(ValueError, match="must hold window_size"):
        FlowGRPOFast(window_size=3, window_fraction=0.5).span(RolloutConfig(num_steps=4))
    with pytest.raises(ValueError, match="includes the last step"):
        FlowGRPOFast(window_fraction=1.0, sde_type="cps").span(RolloutConfig(num_steps=10))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        FlowGRPOFast(sde_type="cps", noise_level=1.2)


# ------------------------------------------------------------------ DiffusionNFT


def test_diffusion_nft_published_values():
    model = parsed("diffusion_nft_published")
    algo = model.generator_algorithm
    assert type(algo) is DiffusionNFT
    assert (algo.beta, algo.timestep_fraction, algo.adv_clip_max) == (1.0, 0.99, 5.0)
    assert (algo.ema_flat, algo.ema_rate, algo.ema_max) == (0, 0.001, 0.5)
    assert model.losses["transformer"].beta == 1e-4 and model.losses["transformer"].rollout_correction == "off"
    assert model.rollout_config.shared_start_noise is False and model.rollout_config.guidance_scale == 1.0
    # The tuned overlay starts each sample from its own noise too (the recipe's shared start is refused).
    assert parsed("diffusion_nft").rollout_config.shared_start_noise is False


def test_diffusion_nft_refuses_a_shared_start_noise():
    shared = SimpleNamespace(config=RolloutConfig(shared_start_noise=True))
    with pytest.raises(ValueError, match=r"model\.rollout\.shared_start_noise=false"):
        DiffusionNFT().bind(SimpleNamespace(parameters=lambda: []), shared, trained=True)
    DiffusionNFT().bind(SimpleNamespace(parameters=lambda: []), shared, trained=False)  # it samples, never trains
    # Through the CLI: the tiny recipe with the overlay, the shared start put back, fails at build time.
    with pytest.raises(ValueError, match="shared_start_noise"):
        tiny("--config", str(OVERLAYS / "diffusion_nft.yaml"), "--model.rollout.shared_start_noise=true")


# ------------------------------------------------------------------ GRPO-Guard with CPS


def test_grpo_guard_is_refused_with_the_cps_step():
    with pytest.raises(ValueError, match=r"guard .* std \* sqrt\(-dt\)"):
        FlowCPS(guard=True)
    with pytest.raises(ValueError, match="guard"):
        FlowGRPOFast(sde_type="cps", guard=True)
    assert FlowGRPO(guard=True).guard and FlowGRPOFast(guard=True).guard, "Guard stays on the SDE step"
    # On the main recipe (FlowCPS) through the CLI, at parse time.
    with pytest.raises(ValueError, match="GRPO-Guard"):
        main(["--config", JOINT, "--model.generator_algorithm.init_args.guard=true", *QUIET], run=False)


# ------------------------------------------------------------------ DAPO and GSPO


def test_dapo_published_values():
    model = parsed("dapo_published")
    algo = model.llm_algorithm
    assert type(algo) is DAPO and algo.aggregation == "token_mean"
    assert algo.clip_eps_high == 0.28 and algo.dynamic_sampling is True and algo.max_groups is None
    assert algo.overlong_buffer == 3 and algo.overlong_penalty_factor == 1.0
    assert model.losses["llm"].clip_eps == 0.2 and model.losses["llm"].beta == 0.0
    assert model.rollout_config.max_new_tokens == 16 and algo.overlong_buffer == int(16 * 4096 / 20480)
    # The generator keeps the recipe's algorithm and loss.
    assert type(model.generator_algorithm) is FlowCPS and model.losses["transformer"].beta == 0.004


def test_gspo_published_values():
    model = parsed("gspo_published")
    algo = model.llm_algorithm
    assert type(algo) is GSPO and (algo.clip_eps_low, algo.clip_eps_high) == (3e-4, 4e-4)
    assert model.losses["llm"].beta == 0.0 and model.losses["transformer"].beta == 0.004


def test_overlong_penalty_by_hand_at_its_three_regimes():
    # L_max 16, L_cache 3: free up to 13 tokens, linear over 14..16, -factor at 16 and beyond.
    lengths = torch.tensor([0, 5, 13, 14, 15, 16, 17, 40])
    want = [0.0, 0.0, 0.0, -1 / 3, -2 / 3, -1.0, -1.0, -1.0]
    assert overlong_penalty(lengths, 16, 3, 1.0).tolist() == pytest.approx(want, abs=1e-12)
    assert overlong_penalty(lengths, 16, 3, 0.5).tolist() == pytest.approx([w / 2 for w in want], abs=1e-12)
    # The buffer the whole length: every token costs factor / L_max.
    assert overlong_penalty(torch.tensor([4, 8]), 8, 8, 1.0).tolist() == pytest.approx([-0.5, -1.0])


def test_dapo_shapes_the_refined_rows_rewards_only_and_only_when_asked():
    record = SimpleNamespace(
        gen_mask=torch.arange(16).expand(4, 16) < torch.tensor([[5], [14], [16], [15]]), rows=torch.tensor([1, 2, 4, 5])
    )
    rewards = torch.tensor([0.5, 0.5, 0.25, 1.0, 0.0, 0.75])
    loop = SimpleNamespace(config=RolloutConfig(max_new_tokens=16))
    assert DAPO().shape_rewards(rewards, record) is None, "off by default"
    dapo = DAPO(overlong_buffer=3)
    dapo.bind(None, loop, trained=True)
    shaped = dapo.shape_rewards(rewards, record)
    assert shaped.tolist() == pytest.approx([0.5, 0.5, 0.25 - 1 / 3, 1.0, 0.0 - 1.0, 0.75 - 2 / 3])
    assert rewards.tolist() == [0.5, 0.5, 0.25, 1.0, 0.0, 0.75], "the reward itself is not modified"
    assert dapo.metrics("llm", record)["llm/overlong_penalty"] == pytest.approx(-(0 + 1 / 3 + 1 + 2 / 3) / 4)
    with pytest.raises(ValueError, match="overlong_buffer=17 exceeds"):
        DAPO(overlong_buffer=17).bind(None, loop, trained=True)
    with pytest.raises(ValueError, match="overlong_buffer must be"):
        DAPO(overlong_buffer=0)


def test_dapo_overlong_penalty_changes_the_refiners_advantages_only():
    # The whole length is the buffer (every refinement pays by its length), and every group stays in the record.
    model, dm = tiny(
        "--model.rollout.num_steps=4",
        "--model.generator_algorithm.init_args.sde_window=[0,2]",
        "--config",
        str(OVERLAYS / "dapo_published.yaml"),
        "--model.llm_algorithm.init_args.overlong_buffer=12",
        "--model.llm_algorithm.init_args.dynamic_sampling=false",
    )
    exp = collect(model, dm)
    record, layout, p = exp.records["ar_decode"], dm.layout, 2
    # Without the shaping: the advantages of the raw reward (shared scheme, one image per text: the same
    # tensor for both experts).
    _, text_adv, image_adv, _ = compute_advantages(exp.rewards.cpu(), layout, p, model.advantage, lambda r: None)
    assert torch.equal(exp.advantages["diffusion_denoise"].cpu(), image_adv), "the generator's are the reward's"
    assert torch.equal(exp.image_advantages.cpu(), image_adv)
    assert torch.equal(exp.text_rewards.cpu(), exp.rewards.cpu().view(-1, layout.images_per_refinement).mean(1))
    # The refiner's: group advantages of the reward minus length / 12 on its refined rows, by hand.
    lengths = record.gen_mask.sum(1).double()
    assert (lengths > 0).all()
    shaped = exp.text_rewards.cpu().double().clone()
    shaped[record.rows] -= lengths / 12
    want = group_advantages(shaped.float(), layout.text_prompt(p), clip_max=model.advantage.clip_max)[record.rows]
    got = exp.advantages["ar_decode"].cpu()
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    assert not torch.allclose(got, text_adv[record.rows], atol=1e-4), "the penalty moved them"
    metrics = model.llm_algorithm.metrics("llm", record)
    assert metrics["llm/overlong_penalty"] == pytest.approx(float(-(lengths / 12).mean()))


# ------------------------------------------------------------------ MixGRPO


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_mix_grpo_never_trains_step_n_minus_2(stride):
    for num_steps in range(4, 30):
        config = RolloutConfig(num_steps=num_steps)
        for size in range(1, num_steps - 2):
            mix = MixGRPO(window_size=size, steps_per_window=1, stride=stride)
            starts = {mix.start_at(step, config) for step in range(4 * num_steps)}
            covered = {s for start in starts for s in range(start, start + size)}
            assert max(covered) <= num_steps - 3, (num_steps, size, stride, sorted(starts))
            if stride == 1:  # it reaches MixGRPO's last full window, [N - 2 - size, N - 2)
                assert max(starts) == num_steps - 2 - size
        with pytest.raises(ValueError, match="does not fit below step num_steps - 2"):
            MixGRPO(window_size=num_steps - 1).last_start(config)


def test_mix_grpo_tuned_overlay_on_the_main_recipe_stays_below_step_8():
    # recipes/algorithms/mix_grpo.yaml on recipes/joint.yaml: 10 steps, windows of 2, 40 training steps.
    mix, config = MixGRPO(window_size=2, steps_per_window=5, stride=1), RolloutConfig(num_steps=10)
    windows = set()
    for step in range(40):
        mix.begin_step(step)
        windows.add(mix.window(config))
    assert windows == {(s, s + 2) for s in range(7)}, sorted(windows)


def test_a_fraction_window_keeps_a_step_after_it_in_shorter_requests():
    # The parity probe samples fewer steps than the rollout; with 9 of 10 steps trained, a 9-step request
    # would end on an SDE step into sigma 0, where the main recipe's DiT showed 5.6e-4 of batch variance.
    config = RolloutConfig(num_steps=10)
    assert FlowGRPO(timestep_fraction=0.99).least_steps(config) == 10
    assert FlowGRPO(timestep_fraction=1.0).least_steps(config) == 10, "the whole schedule: nothing after it"
    assert FlowGRPO(sde_window=(0, 9)).least_steps(config) == 9, "an explicit window is as given"
