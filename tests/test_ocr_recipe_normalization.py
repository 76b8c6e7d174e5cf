"""The OCR recipe's advantages are Flow-GRPO's: each prompt's mean and the whole batch's std of the reward
(its ``PerPromptStatTracker`` with ``global_std``), ``(r - mean_prompt) / (std_batch + 1e-4)`` clipped to 5.

Per-term group normalization with the group's own std would undo ``global_std``: a nearly solved group
(23 images at 1.0, one at 0.95) would give the miss the clip, -5, where Flow-GRPO gives about -0.1.
"""

from __future__ import annotations

import torch
import yaml

from tests.helpers import ROOT
from unirl_pl.layout import GroupLayout
from unirl_pl.method.advantages import AdvantageConfig, compute_advantages
from unirl_pl.rewards import WeightedSum, weighted


def _flow_grpo_advantages(rewards: torch.Tensor, prompt_of: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's formula written out: per-prompt mean, std over every reward of the batch, eps 1e-4, clip 5."""
    std = rewards.double().std(unbiased=False)
    out = torch.empty_like(rewards, dtype=torch.float64)
    for p in prompt_of.unique():
        members = prompt_of == p
        out[members] = (rewards[members].double() - rewards[members].double().mean()) / (std + 1e-4)
    return out.clamp(-5, 5)


def test_the_ocr_recipes_advantages_are_flow_grpos(monkeypatch):
    recipe = yaml.safe_load((ROOT / "recipes" / "sd35_ocr.yaml").read_text())
    model, data = recipe["model"]["init_args"], recipe["data"]["init_args"]
    layout = GroupLayout(data["samples_per_prompt"], data["num_skip_refinement"], data["images_per_refinement"])
    p = data["prompts_per_step"]
    per_prompt = layout.samples_per_prompt * layout.images_per_refinement  # 24 images, one DiT group
    n = p * per_prompt
    g = torch.Generator().manual_seed(0)
    ocr = torch.rand(n, generator=g)
    ocr[:per_prompt] = 1.0
    ocr[5] = 0.95  # prompt 0 is nearly solved: one miss
    fmt = (torch.rand(n, generator=g) > 0.3).float()
    values = {"ocr": ocr, "refiner_format": fmt}
    # The terms' values stand in for the scorers (RapidOCR is not needed to check the arithmetic).
    monkeypatch.setattr(weighted, "resolve_reward", lambda name, args=None: lambda *_: values[name].tolist())
    reward = WeightedSum(
        model["rewards"], model.get("reward_args"), normalize=model.get("reward_normalization", "none")
    )
    prompts = [f"prompt {i // per_prompt}" for i in range(n)]
    groups = layout.text_prompt(p)[layout.image_text(p)]
    total, parts = reward(prompts, prompts, torch.zeros(n, 3, 4, 4), groups=groups)
    config = AdvantageConfig(**model["advantage"])
    _, _, image_adv, _ = compute_advantages(parts.combined, layout, p, config, lambda r: None)

    expected = _flow_grpo_advantages(total, groups)
    torch.testing.assert_close(image_adv.double(), expected, rtol=1e-5, atol=1e-5)
    assert -0.5 < float(image_adv[5]) < 0, "the nearly solved group's miss is a small negative, not the clip"
