"""``recipes/overlays/promptrl.yaml``: PromptRL's loss, group and sampler settings on the main recipe.

The overlay parses on top of ``recipes/joint.yaml`` and gives PromptRL's values (its header names the lines of
G-U-N/UniRL at commit 53c28c9 for each). Two of them are this package's existing formulas standing
in for PromptRL's, so they are checked against PromptRL's written out in float64: the refiner's loss (its
``cot_loss_computation``: ratio ``exp(logp - logp.detach())``, k3 KL at 0.01, each refinement's masked token mean
through the first EOS, then the mean over refinements) and the advantages (its ``compute_advantages``:
population std + 1e-4, clipped to +-5, one per sample for both experts).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from tests.helpers import JOINT, ROOT
from unirl_pl.algorithms import FlowCPS, FlowGRPO, TokenGRPO
from unirl_pl.cli import main
from unirl_pl.group_stats import group_advantages
from unirl_pl.layout import GroupLayout
from unirl_pl.losses import token_policy_loss
from unirl_pl.method.advantages import AdvantageConfig, compute_advantages

OVERLAY = ROOT / "recipes" / "overlays" / "promptrl.yaml"
QUIET = ["--trainer.logger=false", "--trainer.callbacks=[]"]


@cache
def parsed():
    """The CLI of ``recipes/joint.yaml`` + the overlay, parsed (experts not built)."""
    return main(["--config", JOINT, "--config", str(OVERLAY), *QUIET], run=False)


def test_overlay_header_is_its_command_and_names_the_reference_commit():
    text = OVERLAY.read_text()
    assert text.splitlines()[0] == (
        "# python -m unirl_pl fit --config recipes/joint.yaml --config recipes/overlays/promptrl.yaml"
    )
    assert "G-U-N/UniRL" in text and "53c28c9" in text


def test_overlay_gives_promptrls_values():
    cli = parsed()
    model, data = cli.model, cli.datamodule
    algo = model.generator_algorithm
    assert type(algo) is FlowGRPO and not isinstance(algo, FlowCPS), "Flow-GRPO's SDE step, not the recipe's CPS"
    assert algo.sde_window == (0, 4) and algo.level == 0.8 and algo.guard is False
    # PromptRL's window is its first 8 of 20 steps: the same share of the recipe's schedule.
    assert algo.sde_window[1] == 8 * model.rollout_config.num_steps // 20
    dit, llm = model.losses["transformer"], model.losses["llm"]
    assert (dit.clip_eps, dit.beta, dit.kl_form, dit.mini_batches) == (1e-4, 0.01, "promptrl", 1)
    assert (llm.beta, llm.kl_form, llm.mini_batches) == (0.01, "flow_grpo", 1)
    assert type(model.llm_algorithm) is TokenGRPO and model.llm_algorithm.aggregation == "sequence_mean"
    assert model.llm_algorithm.clip_eps_high is None
    assert model.ppo_epochs == 1 and model.ema is None
    assert model.rollout_config.shared_start_noise is False and model.rollout_config.temperature == 1.0
    assert model.advantage == AdvantageConfig(scheme="shared", global_std=False, clip_max=5.0)
    assert data.layout == GroupLayout(samples_per_prompt=8, num_skip_refinement=0, images_per_refinement=1)
    # The main recipe's images per step (8 prompts x 4), as the header explains.
    assert data.prompts_per_step * data.layout.samples_per_prompt == 8 * 4


def test_the_refiner_loss_is_promptrls_cot_loss():
    """``token_policy_loss`` in ``sequence_mean`` with beta 0.01, on-policy (old = the detached recompute, which
    the C2 gate proves the behavior log-prob equals), against PromptRL's formula: value and gradient."""
    g = torch.Generator().manual_seed(0)
    n, t = 5, 7
    logp = (-2.0 + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -2.0 + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.7, 0.0, 2.1, -1.5], dtype=torch.float64)
    eos_at = torch.tensor([2, 6, 0, 4, t])  # t: no EOS, every token counts
    mask = torch.arange(t)[None] <= eos_at[:, None]  # through the first EOS, inclusive

    ours = token_policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref, beta=0.01, aggregation="sequence_mean").loss
    (grad_ours,) = torch.autograd.grad(ours, logp)

    d = ref - logp
    k3 = torch.exp(d) - d - 1
    per_token = -(torch.exp(logp - logp.detach()) * adv[:, None] - 0.01 * k3)
    m = mask.double()
    want = ((per_token * m).sum(1) / m.sum(1).clamp_min(1)).mean()
    (grad_want,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_ours, grad_want, rtol=1e-12, atol=1e-12)


def test_advantages_are_promptrls_one_per_sample_for_both_experts():
    g = torch.Generator().manual_seed(1)
    p, k = 3, 8
    rewards = torch.rand(p * k, generator=g)
    rewards[8:16] = torch.tensor([0.0] * 7 + [1.0])  # the largest z a group of 8 allows, sqrt(7)
    rewards[16:] = 0.5  # no spread: all 0
    layout = GroupLayout(samples_per_prompt=k, num_skip_refinement=0)
    _, text_adv, image_adv, _ = compute_advantages(rewards, layout, p, AdvantageConfig(), lambda r: None)
    grouped = rewards.double().view(-1, k)
    mean = grouped.mean(1).repeat_interleave(k)
    std = grouped.std(1, unbiased=False).repeat_interleave(k)
    want = torch.clamp((rewards.double() - mean) / (std + 1e-4), -5, 5)
    torch.testing.assert_close(text_adv.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(text_adv, image_adv)
    torch.testing.assert_close(group_advantages(rewards, torch.arange(p).repeat_interleave(k)), text_adv)


def test_the_refiner_mask_runs_through_the_first_stop_token():
    """The refiner record's ``gen_mask`` is PromptRL's completion mask: every token up to and including the first
    stop token, or all of them when none was drawn."""
    # The shipped ShapesWorld refiner (the tiny recipe's random one rarely stops), sampled at temperature 1 with a
    # cap of 6 tokens: the short captions stop within it, the long ones run to it (both branches of the rule).
    cli = main(["--config", JOINT, *QUIET, "--model.rollout.max_new_tokens=6"], run=False)
    cli.model.configure_model()
    prompts = ["a crimson disc left of a blue square", "a drawing of two green triangles"] * 8
    _, record = cli.model.ar_decode.sample(prompts, list(range(16)), [0] * 16, "rollout", seed=0)
    stops = torch.tensor(cli.model.llm.stop_token_ids)
    tokens = record.gen_ids
    is_stop = torch.isin(tokens, stops)
    stopped = is_stop.any(1)
    assert bool(stopped.any()) and not bool(stopped.all()), "the check needs rows that stopped and rows that ran on"
    first = torch.where(stopped, is_stop.int().argmax(1), torch.full((tokens.shape[0],), tokens.shape[1]))
    want = torch.arange(tokens.shape[1])[None] <= first[:, None]
    assert torch.equal(record.gen_mask, want)


def test_overlay_file_is_where_the_docs_say():
    assert Path(OVERLAY).is_file()
    assert "recipes/overlays/promptrl.yaml" in (ROOT / "docs" / "shapesworld.md").read_text()
