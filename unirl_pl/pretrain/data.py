"""DataModules for pretraining: rendered ShapesWorld scenes and paraphrase -> caption pairs.

Both stream whole batches from an infinite ``IterableDataset`` whose batch ``i`` is a pure function
of ``(seed, i)``, so a run is reproducible from its recipe and nothing is stored on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from unirl_pl.shapes.edits import (
    EDIT_KINDS,
    EditSpec,
    edit_of,
    make_edit_set,
    paraphrase_edit,
    render_source,
    render_target,
    sample_edit,
)
from unirl_pl.shapes.prompts import make_prompt_set, paraphrase
from unirl_pl.shapes.render import DEFAULT_SIZE, render_batch
from unirl_pl.shapes.scenes import COLORS, caption, sample_scene

# Renders of step i use seed ``seed * _STRIDE + i``; the stride keeps different seeds' streams apart.
_STRIDE = 10_000_000


def scene_batch(seed: int, step: int, batch_size: int, size: int = DEFAULT_SIZE, slots: int = 0) -> dict[str, Any]:
    """Batch ``step`` of the scene stream: ``images`` (B, 3, size, size) in [-1, 1] and ``captions``.

    Categories are uniform (``sample_scene``); images are rendered ground truth for those captions.
    """
    rng = np.random.default_rng((seed, step))
    specs = [sample_scene(rng) for _ in range(batch_size)]
    pixels = render_batch(specs, seed * _STRIDE + step, size, slots)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return {"images": images, "captions": [caption(s) for s in specs]}


def uncolored(text: str) -> str:
    """``text`` without its color words: ``a red circle left of a blue square`` -> ``a circle left of a square``."""
    return " ".join(word for word in text.split() if word not in COLORS)


def _drop_colors(captions: list[str], seed: int, step: int, fraction: float) -> list[str]:
    """``captions`` with that ``fraction`` of them ``uncolored``: the choice draws from its own stream, so the
    prompts and the other captions do not change with it."""
    if fraction <= 0:
        return captions
    drop = np.random.default_rng((seed, step, 1)).random(len(captions)) < fraction
    return [uncolored(c) if d else c for c, d in zip(captions, drop, strict=True)]


def pair_batch(seed: int, step: int, batch_size: int, drop_colors: float = 0.0) -> dict[str, Any]:
    """Batch ``step`` of (train-split paraphrase, canonical caption) pairs as ``prompts``/``captions``.

    With ``drop_colors`` > 0 that fraction of pairs gets its caption without color words (``uncolored``);
    the choice draws from its own stream, so the prompts and the other captions do not change with it.
    """
    rng = np.random.default_rng((seed, step))
    specs = [sample_scene(rng) for _ in range(batch_size)]
    prompts = [paraphrase(s, rng, "train") for s in specs]
    captions = [caption(s) for s in specs]
    captions = _drop_colors(captions, seed, step, drop_colors)
    return {"prompts": prompts, "captions": captions}


def _pixels(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 HWC renders as a (B, 3, H, W) float batch in [-1, 1], the pixel-space DiT's range."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def draw_edits(seed: int, step: int, batch_size: int, heldout: float, slots: int) -> list[EditSpec]:
    """The edits of batch ``step``: kinds uniform, each from the held-out compositions with probability ``heldout``."""
    rng = np.random.default_rng((seed, step))
    edits = []
    for _ in range(batch_size):
        kind = EDIT_KINDS[int(rng.integers(len(EDIT_KINDS)))]
        edits.append(sample_edit(rng, kind, "heldout" if rng.random() < heldout else "train", slots=slots))
    return edits


def edit_batch(seed: int, step: int, batch_size: int, heldout: float = 0.25, slots: int = 2) -> dict[str, Any]:
    """Batch ``step`` of the edit stream: ``sources`` and ``images`` (the targets), (B, 3, 32, 32) in [-1, 1], and
    ``captions``, the canonical instructions. Kinds are uniform; a ``heldout`` fraction of the edits is drawn from
    the held-out compositions, since pretraining is the world (as the scene stream draws every composition) and
    only RL keeps to the train split."""
    edits = draw_edits(seed, step, batch_size, heldout, slots)
    return {
        "sources": _pixels([render_source(e) for e in edits]),
        "images": _pixels([render_target(e) for e in edits]),
        "captions": [e.instruction for e in edits],
    }


def instruction_batch(seed: int, step: int, batch_size: int, drop_colors: float = 0.0) -> dict[str, Any]:
    """Batch ``step`` of (train-phrased instruction, canonical instruction) pairs as ``prompts``/``captions``, of
    train-split edits; ``drop_colors`` as in :func:`pair_batch`."""
    rng = np.random.default_rng((seed, step))
    edits = [sample_edit(rng, EDIT_KINDS[int(rng.integers(len(EDIT_KINDS)))], "train") for _ in range(batch_size)]
    prompts = [paraphrase_edit(e, rng, "train") for e in edits]
    captions = [e.instruction for e in edits]
    captions = _drop_colors(captions, seed, step, drop_colors)
    return {"prompts": prompts, "captions": captions}


def heldout_edit_batches(n: int, seed: int, batch_size: int, slots: int = 2) -> list[dict[str, Any]]:
    """Held-out edits phrased in train words as validation batches: ``prompts`` (the user instructions),
    ``captions`` (canonical), ``rows`` (each edit's JSON row) and ``sources`` (B, 3, 32, 32) in [-1, 1]."""
    rows = make_edit_set(n, seed, "heldout", phrasing="train", slots=slots)
    return [
        {
            "prompts": [r["prompt"] for r in chunk],
            "captions": [r["instruction"] for r in chunk],
            "rows": chunk,
            "sources": _pixels([render_source(edit_of(r)) for r in chunk]),
        }
        for chunk in (rows[i : i + batch_size] for i in range(0, n, batch_size))
    ]


class _Stream(IterableDataset):
    def __init__(self, make: Any, seed: int, batch_size: int) -> None:
        self.make, self.seed, self.batch_size = make, seed, batch_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        step = 0
        while True:
            yield self.make(self.seed, step, self.batch_size)
            step += 1


class _Fixed(torch.utils.data.Dataset):
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.batches[i]


def _heldout_batches(n: int, seed: int, split: str, batch_size: int) -> list[dict[str, Any]]:
    rows = make_prompt_set(n, seed, split)
    return [
        {
            "prompts": [r["prompt"] for r in rows[i : i + batch_size]],
            "captions": [r["caption"] for r in rows[i : i + batch_size]],
        }
        for i in range(0, n, batch_size)
    ]


class _PretrainData(pl.LightningDataModule):
    def __init__(self, batch_size: int, seed: int, val_prompts: int, val_seed: int, val_split: str) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed = batch_size, seed
        self.val_prompts, self.val_seed, self.val_split = val_prompts, val_seed, val_split

    def train_dataloader(self) -> DataLoader:
        # Batches are already whole; rendering is ~0.2 ms per image, so no worker processes are needed.
        return DataLoader(_Stream(self.make_batch, self.seed, self.batch_size), batch_size=None)

    def make_batch(self, seed: int, step: int, batch_size: int) -> dict[str, Any]:
        """Batch ``step`` of this module's stream."""
        raise NotImplementedError

    def val_dataloader(self) -> DataLoader:
        batches = _heldout_batches(self.val_prompts, self.val_seed, self.val_split, self.batch_size)
        return DataLoader(_Fixed(batches), batch_size=None)


class SceneDataModule(_PretrainData):
    """Rendered scenes with canonical captions for flow-matching pretraining of the DiT.

    Args:
        batch_size: Images per optimizer step.
        seed: Seed of the scene stream (batch ``i`` depends only on ``(seed, i)``).
        val_prompts: Held-out prompts scored by sampling at validation (0 disables validation data).
        val_seed: Seed of the held-out prompt set (``make_prompt_set``).
        val_split: Split of the validation prompts (``unirl_pl.shapes.prompts.SPLITS``).
        slots: Render objects centered in distinct cells of a ``slots`` x ``slots`` grid
            (``unirl_pl.shapes.render.layout``); 0 places them freely.
    """

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        val_prompts: int = 48,
        val_seed: int = 1000,
        val_split: str = "canonical",
        slots: int = 0,
    ) -> None:
        super().__init__(batch_size, seed, val_prompts, val_seed, val_split)
        self.slots = slots

    def make_batch(self, seed: int, step: int, batch_size: int) -> dict[str, Any]:
        return scene_batch(seed, step, batch_size, slots=self.slots)


class ParaphraseDataModule(_PretrainData):
    """Train-split (paraphrase, canonical caption) pairs for supervised fine-tuning of the refiner.

    Args:
        batch_size: Pairs per optimizer step.
        seed: Seed of the pair stream (batch ``i`` depends only on ``(seed, i)``).
        val_prompts: Held-out prompts whose greedy refinements are checked at validation.
        val_seed: Seed of the held-out prompt set.
        val_split: Split of the validation prompts: ``composition`` (held-out compositions and
            templates, train words), ``vocabulary`` (unseen words) or ``train``.
        drop_colors: Fraction of training pairs whose target caption leaves out its color words
            (``uncolored``): a systematic labeling error. Above one half, a refiner trained on it drops
            the colors of most colored prompts when decoding greedily and names them in some of its
            samples (the shipped refiner: 40% at temperature 1, all right in a third of those). That is
            one mistake, shared by every prompt with a color, which the reward punishes and RL can undo,
            and which the generator cannot repair (the color is gone from its caption). Validation
            captions keep their colors.
    """

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        val_prompts: int = 60,
        val_seed: int = 1000,
        val_split: str = "composition",
        drop_colors: float = 0.0,
    ) -> None:
        super().__init__(batch_size, seed, val_prompts, val_seed, val_split)
        if not 0.0 <= drop_colors <= 1.0:
            raise ValueError(f"drop_colors must be in [0, 1], got {drop_colors}")
        self.drop_colors = drop_colors

    def make_batch(self, seed: int, step: int, batch_size: int) -> dict[str, Any]:
        return pair_batch(seed, step, batch_size, self.drop_colors)


class EditDataModule(_PretrainData):
    """Rendered ShapesWorld-Edit triples (source, canonical instruction, target) for the edit DiT's pretraining.

    Args:
        batch_size: Edits per optimizer step.
        seed: Seed of the stream (batch ``i`` depends only on ``(seed, i)``).
        val_prompts: Held-out edits (train words) sampled and verified at validation.
        val_seed: Seed of the held-out edits.
        heldout: Fraction of training edits drawn from the held-out compositions (pretraining sees the world).
        slots: Objects sit in the cells of a ``slots`` x ``slots`` grid (2: the scene DiT's pretraining layout).
    """

    def __init__(
        self,
        batch_size: int = 32,
        seed: int = 0,
        val_prompts: int = 50,
        val_seed: int = 1000,
        heldout: float = 0.25,
        slots: int = 2,
    ) -> None:
        super().__init__(batch_size, seed, val_prompts, val_seed, "heldout")
        if not 0.0 <= heldout <= 1.0:
            raise ValueError(f"heldout must be in [0, 1], got {heldout}")
        self.heldout, self.slots = heldout, slots

    def make_batch(self, seed: int, step: int, batch_size: int) -> dict[str, Any]:
        return edit_batch(seed, step, batch_size, self.heldout, self.slots)

    def val_dataloader(self) -> DataLoader:
        batches = heldout_edit_batches(self.val_prompts, self.val_seed, self.batch_size, self.slots)
        return DataLoader(_Fixed(batches), batch_size=None)


class InstructionDataModule(_PretrainData):
    """Train-split (paraphrased instruction, canonical instruction) pairs for the edit refiner's SFT.

    Args:
        batch_size: Pairs per optimizer step.
        seed: Seed of the pair stream.
        val_prompts: Held-out edits (train words) whose greedy refinements are checked at validation.
        val_seed: Seed of the held-out edits.
        drop_colors: Fraction of training pairs whose target instruction leaves out its color words, the
            systematic labeling error of ``ParaphraseDataModule`` (validation instructions keep their colors).
    """

    def __init__(
        self, batch_size: int = 64, seed: int = 0, val_prompts: int = 60, val_seed: int = 1000, drop_colors: float = 0.0
    ) -> None:
        super().__init__(batch_size, seed, val_prompts, val_seed, "heldout")
        if not 0.0 <= drop_colors <= 1.0:
            raise ValueError(f"drop_colors must be in [0, 1], got {drop_colors}")
        self.drop_colors = drop_colors

    def make_batch(self, seed: int, step: int, batch_size: int) -> dict[str, Any]:
        return instruction_batch(seed, step, batch_size, self.drop_colors)

    def val_dataloader(self) -> DataLoader:
        batches = heldout_edit_batches(self.val_prompts, self.val_seed, self.batch_size, slots=0)
        return DataLoader(
            _Fixed([{"prompts": b["prompts"], "captions": b["captions"]} for b in batches]), batch_size=None
        )
