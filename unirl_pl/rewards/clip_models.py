"""Preference and alignment scorers on CLIP models, in process: PickScore, CLIPScore, the LAION aesthetic
predictor (HPSv2, on the same base, is in :mod:`unirl_pl.rewards.hpsv2`).

Each loads its weights with ``transformers`` from a local folder or a hub id (``pretrained_path``), scores
in eval mode without gradients, in batches of ``batch_size`` images, on the device the images arrive on
(or ``device``), with the weights in ``dtype``. Images are quantized to 8 bits first, as every reference
implementation scores PIL images, so a reward scored here and the same reward served over HTTP (PNG)
see the same pixels. Text is the *original* user prompt by default (``prompt="refined"`` scores the
refiner's rewrite instead, which a refiner can game by rewriting toward what the scorer likes).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.frames import FrameReduce, check_frame_args, score_video_frames
from unirl_pl.rewards.loading import load_or_explain, load_state_dict_file

PromptChoice = Literal["original", "refined"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(reward: str, dtype: str) -> torch.dtype:
    """The torch dtype named by ``dtype`` (``float32``, ``float16``, ``bfloat16``)."""
    if dtype not in DTYPES:
        raise ValueError(f"reward {reward!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def quantize(images: Tensor) -> Tensor:
    """Images in [0, 1] rounded to 8 bits (uint8), as a PIL image or a PNG of them would hold them."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)


def unique_texts(texts: list[str]) -> tuple[list[str], Tensor]:
    """The distinct texts in first-seen order and each text's index into them (a group's K samples
    share one prompt, so its text is encoded once)."""
    order = list(dict.fromkeys(texts))
    where = {t: i for i, t in enumerate(order)}
    return order, torch.tensor([where[t] for t in texts], dtype=torch.long)


class CLIPReward(Reward):
    """Base of the CLIP scorers: loading, placement, batching, embeddings and the reward signature.

    Subclasses set ``name`` and implement :meth:`score_embeddings` (or :meth:`score_images`). Videos
    (N, F, 3, H, W) score every ``frame_stride``-th frame and reduce per video by ``frame_reduce``.

    Args:
        pretrained_path: The CLIPModel folder or hub id.
        processor_path: The CLIPProcessor (tokenizer and image processor) folder or hub id; None: the
            model's own.
        prompt: Which text is scored: ``original`` (the user's prompt) or ``refined`` (the rewrite).
        batch_size: Images per forward.
        device: Where the model runs; None follows the images' device.
        dtype: The weights' dtype: ``float32``, ``float16`` or ``bfloat16`` (scores are float32).
        frame_stride: For videos, score every this-many-th frame.
        frame_reduce: For videos, ``mean`` or ``min`` over the scored frames.
    """

    name = "clip"
    accepts_video = True  # samples frames itself (frame_stride, frame_reduce)

    def __init__(
        self,
        pretrained_path: str,
        processor_path: str | None = None,
        prompt: PromptChoice = "original",
        batch_size: int = 32,
        device: str | None = None,
        dtype: str = "float32",
        frame_stride: int = 1,
        frame_reduce: FrameReduce = "mean",
    ) -> None:
        if prompt not in ("original", "refined"):
            raise ValueError(f"reward {self.name!r}: prompt must be 'original' or 'refined', got {prompt!r}")
        if batch_size < 1:
            raise ValueError(f"reward {self.name!r}: batch_size must be >= 1, got {batch_size}")
        check_frame_args(frame_stride, frame_reduce)
        self.pretrained_path, self.processor_path = pretrained_path, processor_path or pretrained_path
        self.prompt, self.batch_size = prompt, batch_size
        self.dtype = torch_dtype(self.name, dtype)
        self.frame_stride, self.frame_reduce = frame_stride, frame_reduce
        self.model, self.processor = self.load()
        self.model.requires_grad_(False).eval()
        self.device = torch.device(device) if device is not None else None
        if self.device is not None:
            self.model.to(self.device)

    # ------------------------------------------------------------------ loading
    def load(self) -> tuple[Any, Any]:
        """(CLIPModel in ``dtype``, CLIPProcessor) from the configured paths."""
        from transformers import CLIPModel, CLIPProcessor

        model = load_or_explain(
            self.name,
            "CLIP model (pretrained_path)",
            self.pretrained_path,
            lambda: CLIPModel.from_pretrained(self.pretrained_path),
        ).to(self.dtype)  # cast after loading: the loading dtype keyword differs across transformers versions
        processor = load_or_explain(
            self.name,
            "CLIP processor (processor_path)",
            self.processor_path,
            lambda: CLIPProcessor.from_pretrained(self.processor_path),
        )
        return model, processor

    def _place(self, images: Tensor) -> torch.device:
        """The device to score on; the model moves there on first use (a rank's own GPU under DDP)."""
        device = self.device or images.device
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        return device

    # ------------------------------------------------------------------ embeddings
    def pixels(self, images: Tensor) -> Tensor:
        """Pixel values for the vision tower from images (N, 3, H, W) in [0, 1], via the model's own
        image processor on the 8-bit images (resize, center crop, normalize), float32 on CPU."""
        arrays = list(quantize(images).permute(0, 2, 3, 1).cpu().numpy())
        # Said, not inferred: the processor guesses the channel axis from the shape, and an image 3 (or 1)
        # pixels tall would be read as channels first.
        processor = self.processor.image_processor
        return processor(images=arrays, return_tensors="pt", input_data_format="channels_last")["pixel_values"]

    @torch.no_grad()
    def image_embeddings(self, images: Tensor) -> Tensor:
        """L2-normalized image embeddings (N, E), float32 on the scoring device."""
        device = self._place(images)
        out = []
        for lo in range(0, images.shape[0], self.batch_size):
            pixels = self.pixels(images[lo : lo + self.batch_size]).to(device=device, dtype=self.dtype)
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output
            out.append(F.normalize(self.model.visual_projection(pooled).float(), dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def text_embeddings(self, texts: list[str], device: torch.device) -> Tensor:
        """L2-normalized text embeddings (T, E) of ``texts``, float32.

        Each distinct text is encoded once and alone, padded to the full context: its embedding then
        never depends on which texts share its batch (a batch's prompts are few after deduplication, so
        this costs little), and a reward served over HTTP in other batches scores bitwise the same.
        """
        order, index = unique_texts(texts)
        max_length = self.model.config.text_config.max_position_embeddings
        out = []
        for text in order:
            tokens = self.processor.tokenizer(
                [text], padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
            ).to(device)
            pooled = self.model.text_model(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            ).pooler_output
            out.append(F.normalize(self.model.text_projection(pooled).float(), dim=-1))
        return torch.cat(out)[index.to(device)]

    # ------------------------------------------------------------------ scores
    def score_embeddings(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        """(N,) scores from matched normalized embeddings; subclasses define the formula."""
        raise NotImplementedError

    def score_images(self, images: Tensor, texts: list[str]) -> Tensor:
        """(N,) float32 CPU scores of images (N, 3, H, W) against ``texts``."""
        image_emb = self.image_embeddings(images)
        return self.score_embeddings(image_emb, self.text_embeddings(texts, image_emb.device)).float().cpu()

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        texts = list(prompts if self.prompt == "original" else refined_prompts)
        if len(texts) != images.shape[0]:
            raise ValueError(f"reward {self.name!r}: {len(texts)} prompts for {images.shape[0]} images")
        if images.ndim == 5:
            return score_video_frames(self.score_images, texts, images, self.frame_stride, self.frame_reduce).tolist()
        if images.ndim != 4:
            raise ValueError(f"reward {self.name!r}: expected (N, 3, H, W) images, got shape {tuple(images.shape)}")
        return self.score_images(images, texts).tolist()


class PickScore(CLIPReward):
    """PickScore (Kirstain et al. 2023): ``scale * exp(logit_scale) * cos(image, text)``.

    ``exp(logit_scale)`` is the trained temperature (about 100 for PickScore_v1), so raw scores sit
    around 18-24. This is PickScore's own definition (the logits its paper trains and ranks with);
    Flow-GRPO divides by 26 before training, others by 100: set ``scale`` to match them (rewards are
    group-normalized, so the scale matters only against other terms' weights).

    Args:
        pretrained_path: PickScore's CLIPModel (``yuvalkirstain/PickScore_v1``).
        processor_path: Its processor (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, as PickScore's authors load it).
        scale: Multiplies the score.
        **kwargs: :class:`CLIPReward`'s prompt, batch_size, device, dtype, frame_stride, frame_reduce.
    """

    name = "pickscore"

    def __init__(
        self,
        pretrained_path: str = "yuvalkirstain/PickScore_v1",
        processor_path: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        scale: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if not math.isfinite(scale):
            raise ValueError(f"reward 'pickscore': scale must be finite, got {scale}")
        self.scale = scale
        super().__init__(pretrained_path, processor_path, **kwargs)

    def score_embeddings(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        temperature = self.model.logit_scale.detach().float().exp().to(image_emb.device)
        return self.scale * temperature * (image_emb * text_emb).sum(-1)


class CLIPScore(CLIPReward):
    """CLIPScore: ``scale * cos(image, text)`` under any CLIPModel (default ``openai/clip-vit-large-patch14``).

    The raw cosine keeps the ranking among poor matches; Hessel et al.'s CLIPScore is
    ``2.5 * max(cos, 0)`` and torchmetrics' ``100 * max(cos, 0)`` (``clamp_negative=True`` with ``scale``).

    Args:
        pretrained_path: Any CLIPModel folder or hub id.
        scale: Multiplies the cosine.
        clamp_negative: Score ``max(cos, 0)`` as the published CLIPScore does.
        **kwargs: :class:`CLIPReward`'s processor_path, prompt, batch_size, device, dtype, frame_stride, frame_reduce.
    """

    name = "clip_score"

    def __init__(
        self,
        pretrained_path: str = "openai/clip-vit-large-patch14",
        scale: float = 1.0,
        clamp_negative: bool = False,
        **kwargs: Any,
    ) -> None:
        if not math.isfinite(scale):
            raise ValueError(f"reward 'clip_score': scale must be finite, got {scale}")
        self.scale, self.clamp_negative = scale, clamp_negative
        super().__init__(pretrained_path, **kwargs)

    def score_embeddings(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        cos = (image_emb * text_emb).sum(-1)
        return self.scale * (cos.clamp_min(0) if self.clamp_negative else cos)


class AestheticMLP(nn.Module):
    """The LAION improved aesthetic predictor's head, in its checkpoint's layout (``layers.{0,2,4,6,7}``):
    Linear(E, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout, Linear(64, 16),
    Linear(16, 1). The dropouts are inactive in eval mode; they keep the checkpoint's indices."""

    def __init__(self, embed_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings).squeeze(-1)


class Aesthetic(CLIPReward):
    """The LAION aesthetic predictor (v2, "improved aesthetic predictor"): its MLP on the L2-normalized
    CLIP ViT-L/14 image embedding; scores roughly 1-10. The prompt is not used.

    Args:
        mlp_path: The MLP's weights (``sac+logos+ava1-l14-linearMSE.pth``, or a ``.safetensors``).
        pretrained_path: The CLIP model it was trained on (``openai/clip-vit-large-patch14``).
        **kwargs: :class:`CLIPReward`'s processor_path, batch_size, device, dtype, frame_stride, frame_reduce.
    """

    name = "aesthetic"

    def __init__(
        self, mlp_path: str | None = None, pretrained_path: str = "openai/clip-vit-large-patch14", **kwargs: Any
    ) -> None:
        if not mlp_path:
            raise ValueError(
                "reward 'aesthetic' needs mlp_path: the LAION aesthetic predictor's weights "
                "(sac+logos+ava1-l14-linearMSE.pth from the improved-aesthetic-predictor release)"
            )
        state = load_state_dict_file(self.name, "aesthetic MLP (mlp_path)", mlp_path)
        if "layers.0.weight" not in state:
            raise ValueError(f"reward 'aesthetic': {mlp_path!r} has no 'layers.0.weight'; keys {sorted(state)[:8]}")
        self.mlp = AestheticMLP(state["layers.0.weight"].shape[1])
        self.mlp.load_state_dict(state)
        self.mlp.requires_grad_(False).eval()
        super().__init__(pretrained_path, **kwargs)
        width = self.model.config.projection_dim
        if width != self.mlp.layers[0].in_features:
            raise ValueError(
                f"reward 'aesthetic': the MLP takes {self.mlp.layers[0].in_features}-d embeddings but the CLIP model "
                f"at {pretrained_path!r} projects to {width}: use the CLIP it was trained on (ViT-L/14: 768)"
            )

    @torch.no_grad()
    def score_images(self, images: Tensor, texts: list[str]) -> Tensor:
        embeddings = self.image_embeddings(images)
        return self.mlp.to(embeddings.device)(embeddings).float().cpu()
