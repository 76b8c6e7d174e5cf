"""Held-out evaluation of the shipped ShapesWorld experts through the RL serve path.

Loads the exported folders by path with the experts' own ``build()`` (so a LoRA adapter with B = 0
is attached exactly as in an RL run), then generates with ``RolloutEngine`` in the deterministic
``serve`` profile: greedy refinement and the ODE sampler. Every condition uses the same per-request
noise, so differences between conditions come from the text alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TextEncoderExpert
from unirl_pl.rewards.shapes import ShapesGenEval
from unirl_pl.rollout import RolloutConfig, RolloutEngine
from unirl_pl.shapes.prompts import make_prompt_set

DEFAULT_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "shapes"


@dataclass
class ShapesExperts:
    """The three shipped experts, built, plus the engine that serves them."""

    transformer: FlowTransformerExpert
    text_encoder: TextEncoderExpert
    llm: CausalLMExpert | None
    engine: RolloutEngine


def load_experts(
    assets: str | Path = DEFAULT_ASSETS, num_steps: int = 10, guidance_scale: float = 1.0, with_refiner: bool = True
) -> ShapesExperts:
    """Build the experts from ``assets`` (``transformer/``, ``text_encoder/``, ``refiner/``) by path."""
    root = Path(assets)
    transformer = FlowTransformerExpert(pretrained_path=str(root), subfolder="transformer")
    text_encoder = TextEncoderExpert(pretrained_path=str(root / "text_encoder"))
    llm = CausalLMExpert(pretrained_path=str(root / "refiner")) if with_refiner else None
    for expert in (transformer, text_encoder, llm):
        if expert is not None:
            expert.build()
    config = RolloutConfig(num_steps=num_steps, sde_window=(0, 1), guidance_scale=guidance_scale, max_new_tokens=16)
    return ShapesExperts(transformer, text_encoder, llm, RolloutEngine(llm, transformer, config))


@torch.no_grad()
def generate(experts: ShapesExperts, texts: list[str], seed: int = 0) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1] for conditioning ``texts`` via the serve-profile ODE."""
    hidden, pooled = experts.text_encoder.encode(texts)
    uncond = experts.text_encoder.encode([""]) if experts.engine.config.guidance_scale != 1.0 else None
    experts.engine.seed = seed
    n = len(texts)
    x, _ = experts.engine.denoise(hidden, pooled, list(range(n)), [0] * n, "serve", uncond=uncond)
    return ((x.float().clamp(-1, 1) + 1) / 2).clamp(0, 1)


@torch.no_grad()
def refine(experts: ShapesExperts, prompts: list[str]) -> list[str]:
    """Greedy (serve-profile) refinements of ``prompts``."""
    if experts.llm is None:
        raise ValueError("these experts were loaded without a refiner")
    texts, _ = experts.engine.refine(prompts, list(range(len(prompts))), [0] * len(prompts), "serve")
    return texts


def evaluate(
    experts: ShapesExperts, n: int = 120, prompt_seed: int = 1000, split: str = "heldout", seed: int = 0
) -> dict[str, dict[str, float]]:
    """Scores per condition on ``n`` ``split`` prompts: ``canonical`` (the DiT given the true caption),
    ``raw`` (given the user prompt) and, with a refiner, ``refined`` (given its greedy rewrite).

    Each image is scored against the user prompt's scene; values are ``ShapesGenEval.per_category``.
    """
    rows = make_prompt_set(n, prompt_seed, split)
    prompts = [r["prompt"] for r in rows]
    conditions = {"canonical": [r["caption"] for r in rows], "raw": prompts}
    if experts.llm is not None:
        conditions["refined"] = refine(experts, prompts)
    scorer = ShapesGenEval()
    return {name: scorer.per_category(prompts, generate(experts, texts, seed)) for name, texts in conditions.items()}
