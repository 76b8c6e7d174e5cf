"""Pieces both pretraining modules share: building the ShapesWorld text encoder, the LR schedule."""

from __future__ import annotations

import math

import torch
from transformers import CLIPTextModelWithProjection

from unirl_pl.experts._common import freeze, seeded_cpu_init
from unirl_pl.experts.text_encoder import TextEncoderExpert
from unirl_pl.pretrain.vocab import build_shapes_tokenizer


def build_text_encoder(expert: TextEncoderExpert) -> None:
    """Build ``expert`` over the ShapesWorld vocabulary (or load it when it has a ``pretrained_path``).

    The expert's own tiny build uses ``DEFAULT_WORDS``, which misses held-out paraphrase words; the
    exported folder saves this tokenizer next to the weights, so loading by path needs nothing else.
    """
    if expert.is_built:
        return
    if expert.pretrained_path is not None:
        expert.build()
        return
    tokenizer = build_shapes_tokenizer("right")
    with seeded_cpu_init(expert.init_seed):
        model = CLIPTextModelWithProjection(expert.tiny_config(tokenizer)).to(expert.dtype)
    expert.tokenizer = tokenizer
    expert.model = freeze(model)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``floor`` x the base lr at ``total``.

    Annealing to a small lr at the end does most of what an EMA of weights would, at no memory cost.
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
