"""CLIP directional similarity of an edit, in process: does the image move the way the text says it should?

The metric InstructPix2Pix (Brooks et al. 2023, ``metrics/clip_similarity.py``: ``sim_direction``) and
StyleGAN-NADA (Gal et al. 2022, the directional CLIP loss) use to score an edit::

    cos( E_img(edited) - E_img(source),  E_txt(target caption) - E_txt(source caption) )

with ``E_img`` and ``E_txt`` CLIP's L2-normalized image and text embeddings. It reads the source image of each
sample (the ``sources`` keyword, :mod:`unirl_pl.rewards.sources`) and, for the two captions, its prompt row
(``metadata``). Loading, preprocessing (8-bit pixels through the model's own image processor), batching and
placement are :class:`~unirl_pl.rewards.clip_models.CLIPReward`'s, so any CLIPModel folder works, a tiny one
built from a config included.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from unirl_pl.rewards.clip_models import CLIPReward, PromptChoice
from unirl_pl.rewards.metadata import Metadata
from unirl_pl.rewards.sources import Source, require_sources, unique_sources


class CLIPDirectional(CLIPReward):
    """CLIP directional similarity: ``scale * cos(E_img(edited) - E_img(source), E_txt(target) - E_txt(source_text))``,
    in [-scale, scale]; an image left as its source scores 0.

    The captions of a sample come from its prompt row when the row has them (``source_caption_key`` and
    ``target_caption_key``, strings; InstructPix2Pix's and OmniEdit's data carry both). Otherwise the *target*
    text is the edit instruction itself (the original one, or the refiner's rewrite with ``prompt: refined``) and
    the *source* text is ``source_text``, a neutral caption ("a photo"): the direction is then the one from a plain
    photo toward the instruction's words, a weaker signal than real captions (an instruction reads "make it
    red", not "a red car") but one every editing prompt file gives. Each sample needs a source image; a call
    without them is an error that says so.

    Args:
        pretrained_path: Any CLIPModel folder or hub id (InstructPix2Pix reports ViT-L/14).
        processor_path: Its processor (tokenizer and image processor); None: the model's own.
        prompt: The instruction used as the target text when a row has no target caption: ``original`` (the
            user's) or ``refined`` (the rewrite the generator saw).
        source_caption_key: The prompt row's field holding the source image's caption (PromptRL's OmniEdit rows
            call it ``caption``).
        target_caption_key: The prompt row's field holding the caption of the image the edit should give.
        source_text: The source caption of a sample whose row has none.
        scale: Multiplies the cosine.
        batch_size: Images per forward of the vision tower.
        device: Where the model runs; None follows the images' device.
        dtype: The weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (scores are float32).
    """

    name = "clip_directional"
    accepts_video = False  # a video is scored frame by frame, each frame against its video's source

    def __init__(
        self,
        pretrained_path: str = "openai/clip-vit-large-patch14",
        processor_path: str | None = None,
        prompt: PromptChoice = "original",
        source_caption_key: str = "source_caption",
        target_caption_key: str = "target_caption",
        source_text: str = "a photo",
        scale: float = 1.0,
        batch_size: int = 32,
        device: str | None = None,
        dtype: str = "float32",
    ) -> None:
        if not math.isfinite(scale):
            raise ValueError(f"reward {self.name!r}: scale must be finite, got {scale}")
        if not source_caption_key or not target_caption_key or source_caption_key == target_caption_key:
            raise ValueError(
                f"reward {self.name!r}: source_caption_key and target_caption_key must be two different field names, "
                f"got {source_caption_key!r} and {target_caption_key!r}"
            )
        self.scale, self.source_text = scale, source_text
        self.source_caption_key, self.target_caption_key = source_caption_key, target_caption_key
        super().__init__(
            pretrained_path, processor_path, prompt=prompt, batch_size=batch_size, device=device, dtype=dtype
        )

    def captions(self, instructions: list[str], metadata: list[Metadata] | None) -> tuple[list[str], list[str]]:
        """(source captions, target captions) of the samples: their rows' fields, else ``source_text`` and the
        instruction."""
        rows = metadata if metadata is not None else [None] * len(instructions)
        if len(rows) != len(instructions):
            raise ValueError(f"reward {self.name!r}: {len(rows)} metadata items for {len(instructions)} samples")
        sources, targets = [], []
        for i, (row, instruction) in enumerate(zip(rows, instructions, strict=True)):
            source, target = self.source_text, instruction
            if isinstance(row, dict):
                source = self._field(row, self.source_caption_key, i, source)
                target = self._field(row, self.target_caption_key, i, target)
            sources.append(source)
            targets.append(target)
        return sources, targets

    def _field(self, row: dict[str, Any], key: str, i: int, default: str) -> str:
        value = row.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            what = type(value).__name__
            raise ValueError(f"reward {self.name!r}: metadata[{i}][{key!r}] must be a string, got {what}")
        return value

    def source_embeddings(self, sources: list[Tensor], device: torch.device) -> Tensor:
        """L2-normalized embeddings (N, E) of per-sample source images of any sizes, each distinct source embedded
        once, on ``device`` (where the edited images were: the model stays there)."""
        firsts, index = unique_sources(sources)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for j, image in enumerate(firsts):
            by_shape.setdefault(tuple(image.shape), []).append(j)
        embedded: list[Tensor | None] = [None] * len(firsts)
        for members in by_shape.values():
            out = self.image_embeddings(torch.stack([firsts[j] for j in members]).to(device))
            for j, row in zip(members, out, strict=True):
                embedded[j] = row
        table = torch.stack(embedded)  # type: ignore[arg-type]
        return table[torch.tensor(index, device=table.device)]

    def __call__(  # type: ignore[override]
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[Metadata] | None = None,
        sources: list[Source] | None = None,
    ) -> list[float]:
        n = images.shape[0]
        if images.ndim != 4:
            raise ValueError(f"reward {self.name!r}: expected (N, 3, H, W) images, got shape {tuple(images.shape)}")
        if len(prompts) != n or len(refined_prompts) != n:
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts and {len(refined_prompts)} refined for {n}")
        originals = require_sources(sources, n, f"reward {self.name!r}")
        instructions = list(prompts if self.prompt == "original" else refined_prompts)
        source_texts, target_texts = self.captions(instructions, metadata)
        edited = self.image_embeddings(images)
        device = edited.device
        before = self.source_embeddings(originals, device)
        image_direction = edited - before
        text_direction = self.text_embeddings(target_texts, device) - self.text_embeddings(source_texts, device)
        # A zero direction (the image left as it was, or two equal captions) gives 0, not NaN (the eps).
        cos = F.cosine_similarity(image_direction, text_direction, dim=-1)
        return (self.scale * cos).float().cpu().tolist()
