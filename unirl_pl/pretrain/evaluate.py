"""Held-out evaluation of the shipped ShapesWorld experts through the RL serve path.

Loads the exported folders by path with the experts' own ``build()`` (so a LoRA adapter with B = 0
is attached exactly as in an RL run), then generates with the RL loops in the deterministic
``serve`` profile: greedy refinement and the ODE sampler. Every condition uses the same per-request
noise, so differences between conditions come from the text alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TextEncoderExpert
from unirl_pl.generators import ComponentGenerator
from unirl_pl.loops import ARDecode, DiffusionDenoise, RolloutConfig
from unirl_pl.rewards.shapes import ShapesGenEval
from unirl_pl.shapes.prompts import make_prompt_set

DEFAULT_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "shapes"
# The schedule shift the shipped DiT was pretrained with (recipes/shapes/pretrain_dit.yaml).
SHIPPED_SHIFT = 3.0


@dataclass
class ShapesExperts:
    """The three shipped experts, built, plus the loops that serve them."""

    generator: ComponentGenerator
    llm: CausalLMExpert | None
    diffusion_denoise: DiffusionDenoise
    ar_decode: ARDecode | None


def load_experts(
    assets: str | Path = DEFAULT_ASSETS,
    num_steps: int = 10,
    guidance_scale: float = 1.0,
    with_refiner: bool = True,
    shift: float = SHIPPED_SHIFT,
) -> ShapesExperts:
    """Build the experts from ``assets`` (``transformer/``, ``text_encoder/``, ``refiner/``) by path."""
    root = Path(assets)
    generator = ComponentGenerator(
        FlowTransformerExpert(pretrained_path=str(root), subfolder="transformer"),
        TextEncoderExpert(pretrained_path=str(root / "text_encoder")),
        vae=None,
    )
    generator.build()
    llm = CausalLMExpert(pretrained_path=str(root / "refiner")) if with_refiner else None
    if llm is not None:
        llm.build()
    config = RolloutConfig(num_steps=num_steps, guidance_scale=guidance_scale, max_new_tokens=16, shift=shift)
    ar = ARDecode(llm, config) if llm is not None else None
    return ShapesExperts(generator, llm, DiffusionDenoise(generator, config), ar)


@torch.no_grad()
def generate(experts: ShapesExperts, texts: list[str], seed: int = 0) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1] for conditioning ``texts`` via the serve-profile ODE."""
    loop, generator = experts.diffusion_denoise, experts.generator
    uncond = generator.encode([""]) if loop.config.guided else None
    n = len(texts)
    x, _ = loop.sample(generator.encode(texts), list(range(n)), [0] * n, "serve", seed=seed, uncond=uncond)
    return generator.decode(x)


@torch.no_grad()
def refine(experts: ShapesExperts, prompts: list[str]) -> list[str]:
    """Greedy (serve-profile) refinements of ``prompts``."""
    if experts.ar_decode is None:
        raise ValueError("these experts were loaded without a refiner")
    texts, _ = experts.ar_decode.sample(prompts, list(range(len(prompts))), [0] * len(prompts), "serve", seed=0)
    return texts


def evaluate(
    experts: ShapesExperts, n: int = 120, prompt_seed: int = 1000, split: str = "composition", seed: int = 0
) -> dict[str, dict[str, float]]:
    """Scores per condition on ``n`` ``split`` prompts: ``canonical`` (the DiT given the true caption),
    ``chance`` (given another prompt's caption: the list rolled by 3, so a different category),
    ``raw`` (given the user prompt) and, with a refiner, ``refined`` (given its greedy rewrite; its
    ``exact_match`` is the fraction of rewrites equal to the canonical caption).

    Each image is scored against the user prompt's scene; values are ``ShapesGenEval.per_category``.
    """
    rows = make_prompt_set(n, prompt_seed, split)
    prompts = [r["prompt"] for r in rows]
    captions = [r["caption"] for r in rows]
    conditions = {"canonical": captions, "chance": captions[3:] + captions[:3], "raw": prompts}
    if experts.llm is not None:
        conditions["refined"] = refine(experts, prompts)
    scorer = ShapesGenEval()
    scores = {name: scorer.per_category(prompts, generate(experts, texts, seed)) for name, texts in conditions.items()}
    if "refined" in scores:
        exact = [r == c for r, c in zip(conditions["refined"], captions, strict=True)]
        scores["refined"]["exact_match"] = sum(exact) / max(1, len(exact))
    return scores
