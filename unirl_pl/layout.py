"""The group layout of one step as pure index math: which prompt, text sample and image each row is.

The data module yields it with every batch; the rollout, the advantages and the memory planner read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def check_prompt_counts(prompts_per_step: int = 4, val_batch_size: int = 8, val_images_per_prompt: int = 1) -> None:
    """Refuse a data module's prompt counts that are not positive integers.

    The one check of these settings: ``PromptDataModule`` runs it when ``fit`` builds the data, and ``plan``
    on the recipe it reads without building anything, so both refuse the same values with the same words.
    """
    for name, value in (
        ("prompts_per_step", prompts_per_step),
        ("val_batch_size", val_batch_size),
        ("val_images_per_prompt", val_images_per_prompt),
    ):
        # fit's parser checks the type already; plan reads raw YAML, where a string or a float may come.
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class GroupLayout:
    """Samples per prompt: K text samples (``skip`` of them unrefined) and M images per text sample.

    Args:
        samples_per_prompt: K, text samples per prompt; the LM's group size (>= 2).
        num_skip_refinement: Of each prompt's K samples, how many keep the original prompt.
        images_per_refinement: M, images per text sample.
    """

    samples_per_prompt: int = 4
    num_skip_refinement: int = 1
    images_per_refinement: int = 1

    def __post_init__(self) -> None:
        k = self.samples_per_prompt
        if k < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 (a group of one has no relative advantage), got {k}")
        if not 0 <= self.num_skip_refinement < k:
            raise ValueError(
                f"num_skip_refinement must be in [0, samples_per_prompt={k}), got {self.num_skip_refinement}: "
                "at least one sample per prompt must be refined"
            )
        if self.images_per_refinement < 1:
            raise ValueError(f"images_per_refinement must be >= 1, got {self.images_per_refinement}")

    def text_prompt(self, p: int) -> Tensor:
        """(P*K,) the prompt of each text sample."""
        return torch.arange(p).repeat_interleave(self.samples_per_prompt)

    def text_sample_index(self, p: int) -> list[int]:
        """(P*K,) each text sample's index within its prompt's group."""
        return [j for _ in range(p) for j in range(self.samples_per_prompt)]

    def refined_rows(self, p: int, refine: bool) -> list[int]:
        """The text samples the LM refines (none when the refiner does not run)."""
        if not refine:
            return []
        return [i for i, j in enumerate(self.text_sample_index(p)) if j >= self.num_skip_refinement]

    def image_text(self, p: int) -> Tensor:
        """(P*K*M,) the text sample each image renders."""
        return torch.arange(p * self.samples_per_prompt).repeat_interleave(self.images_per_refinement)

    def image_sample_index(self, p: int) -> list[int]:
        """(P*K*M,) each image's sample index within its request (seeds its noise)."""
        m = self.images_per_refinement
        return [j * m + i for j in self.text_sample_index(p) for i in range(m)]
