"""Pieces both pretraining modules share: building the ShapesWorld text encoder, the LR schedule."""

from __future__ import annotations

import hashlib
import math

import torch
from transformers import CLIPTextModelWithProjection

from unirl_pl.experts._common import freeze, seeded_cpu_init
from unirl_pl.experts.text_encoder import TextEncoderExpert
from unirl_pl.pretrain.vocab import build_shapes_tokenizer


def build_text_encoder(expert: TextEncoderExpert, vocabulary: str = "scenes") -> None:
    """Build ``expert`` over the ShapesWorld ``vocabulary`` (``scenes`` or ``edits``, see ``build_shapes_tokenizer``),
    or load it when it has a ``pretrained_path``.

    The expert's own tiny build uses ``DEFAULT_WORDS``, which misses held-out paraphrase words; the
    exported folder saves this tokenizer next to the weights, so loading by path needs nothing else. A loaded
    encoder whose tokenizer lacks words of ``vocabulary`` gets them: the vocabularies only append words, so its
    ids stay and its embedding table grows by the new rows (``resize_token_embeddings``, drawn from the old
    rows' mean and covariance with the global RNG, seeded by the run).
    """
    if expert.is_built:
        return
    tokenizer = build_shapes_tokenizer("right", vocabulary)
    if expert.pretrained_path is not None:
        expert.build()
        loaded = expert.tokenizer.get_vocab()
        if len(loaded) < len(tokenizer):
            wanted = tokenizer.get_vocab()
            if any(wanted.get(word) != i for word, i in loaded.items()):
                raise ValueError(
                    f"the text encoder at {expert.pretrained_path} has a vocabulary that {vocabulary!r} does not extend"
                )
            expert.model.resize_token_embeddings(len(tokenizer))
            expert.tokenizer = tokenizer
        return
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


def weights_sha256(params: list[torch.nn.Parameter]) -> str:
    """SHA-256 of the parameters' float32 bytes in order: equal hashes mean bit-identical weights."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
