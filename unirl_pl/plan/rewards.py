"""The recipe's reward models in a plan: which reward terms hold a torch model on the trainer's device, that
model at its real size on fake tensors, and the scoring the step runs between the VAE decode and the update.

The in-process scorers (``pickscore``, ``clip_score``, ``aesthetic``, ``hpsv2``, or a dotted path to another
:class:`~unirl_pl.rewards.clip_models.CLIPReward`) load a ``transformers`` CLIPModel (``imagereward`` its BLIP,
built from ImageReward-v1.0's config; ``hpsv3``'s Qwen2-VL-7B is named as not counted) and move it to the device
the images arrive on at their first call, where it stays: its weights are resident in every phase of the
steady-state step, and its forwards (``batch_size`` images at a time, one text at a time) run in the
``reward`` phase through the reward's own ``score_images``. The CLIP config is read from a local folder's
``config.json`` (the reward's ``pretrained_path``; HPSv2's ``clip_path``), else from the public checkpoint
it names, whose shape is written out below (no weights or config files are shipped for them), else from the
reward's default checkpoint. The other rewards score on the host (RapidOCR on onnxruntime, JPEG sizes, text
rules) or on another machine (``http``, ``vlm_judge``): on the device they only make the images' 8-bit copy
that leaves it, which the ``reward`` phase traces alongside when it runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import BatchEncoding, CLIPConfig, CLIPModel

from unirl_pl.plan.models import default_dtype, to_fake
from unirl_pl.rewards.clip_models import Aesthetic, AestheticMLP, CLIPReward, quantize
from unirl_pl.rewards.frames import score_video_frames
from unirl_pl.rewards.hpsv2 import HPSv2
from unirl_pl.rewards.imagereward import ImageReward, ImageRewardModel, imagereward_blip_config

# The public CLIP checkpoints the in-process rewards load, by their config.json (the hub repositories'):
# ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K; PickScore_v1 and HPSv2 fine-tune the same shape),
# 986.1M parameters; ViT-L/14 (openai/clip-vit-large-patch14), 427.6M.
_VIT_H_14: dict[str, Any] = {
    "projection_dim": 1024,
    "text_config": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
        "max_position_embeddings": 77, "vocab_size": 49408, "hidden_act": "gelu", "projection_dim": 1024,
    },
    "vision_config": {
        "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16, "num_hidden_layers": 32,
        "patch_size": 14, "image_size": 224, "hidden_act": "gelu", "projection_dim": 1024,
    },
}  # fmt: skip
_VIT_L_14: dict[str, Any] = {
    "projection_dim": 768,
    "text_config": {
        "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
        "max_position_embeddings": 77, "vocab_size": 49408, "hidden_act": "quick_gelu", "projection_dim": 768,
    },
    "vision_config": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
        "patch_size": 14, "image_size": 224, "hidden_act": "quick_gelu", "projection_dim": 768,
    },
}  # fmt: skip
PUBLIC_CLIPS: dict[str, tuple[str, dict[str, Any]]] = {
    "CLIP-ViT-H-14-laion2B-s32B-b79K": ("CLIP ViT-H/14", _VIT_H_14),
    "PickScore_v1": ("CLIP ViT-H/14", _VIT_H_14),
    "clip-vit-large-patch14": ("CLIP ViT-L/14", _VIT_L_14),
}
"""Public CLIP checkpoints by the last part of their hub id: (architecture, config.json values)."""

DEVICE_REWARDS: dict[str, str] = {
    "pickscore": "unirl_pl.rewards.clip_models.PickScore",
    "clip_score": "unirl_pl.rewards.clip_models.CLIPScore",
    "aesthetic": "unirl_pl.rewards.clip_models.Aesthetic",
    "hpsv2": "unirl_pl.rewards.hpsv2.HPSv2",
    "imagereward": "unirl_pl.rewards.imagereward.ImageReward",
    "clip_directional": "unirl_pl.rewards.clip_directional.CLIPDirectional",
}
"""The registered rewards that run a torch model in the trainer's process."""

HOST_REWARDS: dict[str, str] = {
    "ocr": "RapidOCR on onnxruntime, on the host",
    "http": "a reward server (another process or machine)",
    "vlm_judge": "a VLM server over HTTP",
    "shapes_geneval": "numpy on the host",
    "shapes_edit": "numpy on the host",
    "jpeg_compressibility": "JPEG encoding on the host",
    "jpeg_incompressibility": "JPEG encoding on the host",
    "brightness": "a mean over the images",
    "contains_word": "the refined text only",
    "refiner_format": "the refined text only",
    "edit_judge": "a VLM server over HTTP",
    "promptrl_format": "the refiner's replies only",
    "promptrl_edit_format": "the refiner's replies only",
}
"""Where the other registered rewards score (none holds a model on the trainer's device)."""

UNTRACED_DEVICE_REWARDS: dict[str, str] = {
    "hpsv3": "its Qwen2-VL-7B in the trainer's process, NOT counted by this plan",
}
"""In-process rewards whose models the plan does not build yet: named, so a plan never passes them off as free."""


@dataclass
class PlannedReward:
    """One reward term of the recipe as the plan counts it.

    Args:
        name: The term's name in ``model.rewards``.
        where: Where it scores, in words.
        scorer: The in-process scorer with its fake (or real, to check a plan) CLIP model on this rank's
            device; None for a term that holds no model there.
        architecture: The scorer's model, in words, and where its config came from.
        parameters: Its parameter count.
        weight_bytes: Bytes of its parameters and buffers on the device.
        batch_size: Images per forward.
        untraced: The term holds a model on the device that this plan does not build (its memory is missing).
    """

    name: str
    where: str
    scorer: CLIPReward | None = None
    architecture: str = ""
    parameters: int = 0
    weight_bytes: int = 0
    batch_size: int = 0
    untraced: bool = False

    @property
    def on_device(self) -> bool:
        """Whether the term's model is on this rank's device."""
        return self.scorer is not None

    def line(self) -> str:
        """The report's line for this term."""
        if self.untraced:
            return f"reward {self.name}: {self.where}: add its weights to the peak by hand"
        if not self.on_device:
            return f"reward {self.name}: scored by {self.where}; no model on the device"
        return (
            f"reward {self.name}: {self.architecture}, {self.parameters / 1e9:.2f}B parameters in "
            f"{str(self.scorer.dtype).removeprefix('torch.')}, {self.weight_bytes / 2**30:.2f} GiB on each rank's "
            f"device in every phase; {self.batch_size} images per forward in the reward phase"
        )


def _class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _default(cls: type, key: str) -> Any:
    """The default of ``cls``'s (or a base's) ``__init__`` argument ``key``."""
    import inspect

    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameter = inspect.signature(init).parameters.get(key)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return None


def clip_config(cls: type, kwargs: dict[str, Any]) -> tuple[CLIPConfig, str]:
    """The CLIP config ``cls(**kwargs)`` would load and where it came from: a local folder's ``config.json``,
    else the public checkpoint the path names, else the reward's default checkpoint."""
    key = "clip_path" if issubclass(cls, HPSv2) else "pretrained_path"
    default = _default(cls, key)
    for candidate in (kwargs.get(key), default):
        if not candidate:
            continue
        folder = Path(str(candidate)).expanduser()
        if (folder / "config.json").is_file():
            return CLIPConfig.from_pretrained(str(folder)), f"CLIP from {folder}"
        known = PUBLIC_CLIPS.get(folder.name)
        if known is not None:
            architecture, values = known
            return CLIPConfig(**values), f"{architecture} ({candidate})"
    raise FileNotFoundError(
        f"reward {cls.__name__}: no CLIP config for {kwargs.get(key) or default!r}: give a local folder with its "
        f"config.json as {key}, or one of the public checkpoints {', '.join(PUBLIC_CLIPS)}"
    )


class _Tokenizer:
    """Every text becomes ``max_length`` ids, as the scorers pad them (``padding="max_length"``)."""

    def __call__(self, texts: list[str], max_length: int | None = None, **_: Any) -> BatchEncoding:
        ids = torch.ones(len(texts), int(max_length or 77), dtype=torch.long)
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


class _ImageProcessor:
    image_mean = (0.48145466, 0.4578275, 0.40821073)
    image_std = (0.26862954, 0.26130258, 0.27577711)


class _Processor:
    """Stands in for ``CLIPProcessor``: the tokenizer and the normalization constants the scorers read."""

    tokenizer = _Tokenizer()
    image_processor = _ImageProcessor()


def _host_pixels(scorer: CLIPReward):
    """``CLIPReward.pixels`` as the device sees it: the 8-bit copy of the images made on the device for the
    image processor (which runs on the host), then the processor's float32 pixel values (resized to the vision
    tower's input) that ``image_embeddings`` copies back in the model's dtype."""

    def pixels(images: Tensor) -> Tensor:
        quantize(images)
        size = scorer.model.config.vision_config.image_size
        return torch.empty(images.shape[0], 3, size, size)

    return pixels


def build_scorer(cls: type, kwargs: dict[str, Any], mode: FakeTensorMode | None) -> tuple[CLIPReward, str]:
    """``cls``'s scorer with its CLIP model (ImageReward: its BLIP) at real size: fake in ``mode`` (random
    weights on the CPU when ``mode`` is None, to check a plan); the reward's own settings (``dtype``,
    ``batch_size``, ``prompt``, frame sampling) as ``kwargs`` give them. Returns the scorer and its model in
    words."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        kwargs.get("dtype", "float32"), torch.float32
    )
    model: torch.nn.Module
    if issubclass(cls, ImageReward):
        model, what = _imagereward_model(kwargs, dtype)
    else:
        config, what = clip_config(cls, kwargs)
        with torch.device("meta"), default_dtype(dtype):
            model = CLIPModel(config)
    modules: list[torch.nn.Module] = [model]
    scorer = cls.__new__(cls)
    # CLIPReward's own constructor with the model given instead of loaded (the subclass constructors read
    # weight files); the subclass settings its scores read are set after it.
    processor = _Tokenizer() if issubclass(cls, ImageReward) else _Processor()
    scorer.load = lambda: (model, processor)  # type: ignore[method-assign]
    settings = ("prompt", "batch_size", "dtype", "frame_stride", "frame_reduce")
    CLIPReward.__init__(scorer, "plan", "plan", **{k: kwargs[k] for k in settings if k in kwargs})
    scorer.scale, scorer.clamp_negative = float(kwargs.get("scale", 1.0)), bool(kwargs.get("clamp_negative", False))
    if issubclass(cls, Aesthetic):
        with torch.device("meta"):
            mlp = AestheticMLP(config.projection_dim).requires_grad_(False).eval()
        # ``score_images`` moves the head to the embeddings' device, where it already is: no copy to trace
        # (and fake parameters cannot be swapped in place).
        mlp.to = lambda *args, **kwargs: mlp  # type: ignore[method-assign]
        scorer.mlp = mlp
        modules.append(mlp)
    if not issubclass(cls, HPSv2):  # HPSv2 transforms the images on the device itself
        scorer.pixels = _host_pixels(scorer)  # type: ignore[method-assign]
    if mode is not None:
        to_fake(modules, mode)
    else:
        for module in modules:
            module.to_empty(device="cpu")
        for module in model.modules():  # the index inputs to_empty left uninitialized
            ids = getattr(module, "position_ids", None)
            if isinstance(ids, Tensor):
                ids.copy_(torch.arange(ids.shape[-1]).expand_as(ids))
    return scorer, what


def _imagereward_model(kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[ImageRewardModel, str]:
    """ImageReward's BLIP (ViT + text encoder with cross-attention) and head on the meta device, from its
    ``blip_config_path`` folder or ImageReward-v1.0's config (the head in float32, as the reward keeps it)."""
    from transformers import BlipConfig, BlipTextModel, BlipVisionModel

    path = kwargs.get("blip_config_path")
    if path and (Path(str(path)).expanduser() / "config.json").is_file():
        config, what = BlipConfig.from_pretrained(str(path)), f"BLIP from {path}"
    else:
        config, what = imagereward_blip_config(), "ImageReward-v1.0's BLIP (ViT-L/16 + BERT-base)"
    with torch.device("meta"), default_dtype(dtype):
        vision = BlipVisionModel(config.vision_config)
        text = BlipTextModel(config.text_config, add_pooling_layer=False)
    with torch.device("meta"):
        mlp = AestheticMLP(config.text_config.hidden_size)
    return ImageRewardModel(config, vision, text, mlp).requires_grad_(False).eval(), what


def planned_rewards(
    rewards: dict[str, dict[str, Any]], mode: FakeTensorMode | None, paths: dict[str, str] | None = None
) -> list[PlannedReward]:
    """Each reward term of the recipe (name -> its arguments) as the plan counts it; ``paths`` gives the class of
    the terms a recipe gives as components. A term whose ``device`` is set to the CPU or another device holds
    nothing on this rank's device."""
    out = []
    for name, kwargs in rewards.items():
        path = (paths or {}).get(name) or DEVICE_REWARDS.get(name, name if "." in name else "")
        cls = _class(path) if path else None
        untraced = UNTRACED_DEVICE_REWARDS.get(getattr(cls, "name", None) or name)
        if untraced is not None:
            out.append(PlannedReward(name, untraced, untraced=True))
            continue
        if not (isinstance(cls, type) and issubclass(cls, CLIPReward)):
            where = HOST_REWARDS.get(name, "a custom reward the plan does not trace")
            out.append(PlannedReward(name, where))
            continue
        device = kwargs.get("device")
        if device is not None and str(device) not in ("cuda", "gpu"):
            out.append(PlannedReward(name, f"its model on {device!r}, not the trainer's device"))
            continue
        scorer, what = build_scorer(cls, kwargs, mode)
        modules = [scorer.model, *([scorer.mlp] if isinstance(scorer, Aesthetic) else [])]
        tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        out.append(
            PlannedReward(
                name,
                "its model in the trainer's process",
                scorer,
                what,
                parameters=sum(p.numel() for m in modules for p in m.parameters()),
                weight_bytes=sum(t.numel() * t.element_size() for t in tensors),
                batch_size=scorer.batch_size,
            )
        )
    return out


def reward_models(planned: list[PlannedReward]) -> list[torch.nn.Module]:
    """The models the reward terms keep on this rank's device (resident in every phase)."""
    models: list[torch.nn.Module] = []
    for term in planned:
        if term.scorer is not None:
            models.append(term.scorer.model)
            if isinstance(term.scorer, Aesthetic):
                models.append(term.scorer.mlp)
    return models


def score(planned: list[PlannedReward], images: Tensor, prompts: list[str]) -> None:
    """The step's reward scoring on the device: each in-process scorer's ``score_images`` (frames of videos
    as ``score_video_frames`` samples them), and the 8-bit copy of the images every other image reward makes
    before the images leave the device."""
    with torch.no_grad():
        for term in planned:
            scorer = term.scorer
            if scorer is None:
                if term.where.startswith(("the refined text", "a mean")):
                    continue
                quantize(images)
                continue
            if images.ndim == 5:
                score_video_frames(scorer.score_images, prompts, images, scorer.frame_stride, scorer.frame_reduce)
            else:
                scorer.score_images(images, prompts)
