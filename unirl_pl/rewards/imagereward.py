"""ImageReward (Xu et al. 2023) in process: the released ``ImageReward.pt`` converted into ``transformers``' BLIP.

The ``image-reward`` package does not import with transformers 5 (it imports ``apply_chunking_to_forward``
from ``transformers.modeling_utils``), and it needs OpenAI's ``clip`` and ``timm==0.6.13``. Its checkpoint is
BLIP's original layout (``blip.visual_encoder.*``: a timm ViT-L/16; ``blip.text_encoder.*``: BLIP's
``med.py`` BERT with cross-attention; ``mlp.layers.*``: the reward head). The ViT's tensors are renamed
into :class:`transformers.BlipVisionModel`, the BERT's already carry :class:`transformers.BlipTextModel`'s
names (the text encoder of ``BlipForImageTextRetrieval``), and the head is the same MLP as the LAION
aesthetic predictor's (:class:`~unirl_pl.rewards.clip_models.AestheticMLP`).

Read from THUDM/ImageReward at commit c1392c6dd0fd6ecd6d416c96959ab744a6d0a8fb: ``ImageReward/ImageReward.py``
(``ImageReward.score``/``inference_rank``, ``MLP``, ``_transform``, ``mean``/``std``), ``ImageReward/utils.py``
(``load``), ``ImageReward/models/BLIP/{blip,blip_pretrain,vit,med}.py`` and ``train/src/config/med_config.json``.
The key renames follow transformers' ``models/blip/convert_blip_original_pytorch_to_hf.py``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from unirl_pl.rewards.clip_models import (
    AestheticMLP,
    CLIPReward,
    quantize,
    unique_texts,
)
from unirl_pl.rewards.loading import checkpoint_path, load_or_explain, load_state_dict_file

if TYPE_CHECKING:  # transformers is imported where a model is built: it loads slowly
    from transformers import BertTokenizer, BlipConfig

HUB_ID = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
WHERE = f"ImageReward-v1.0's {CHECKPOINT_FILE}, from https://huggingface.co/{HUB_ID}"

# ImageReward.py: ``self.mean``/``self.std``, the reward's normalization (score = (mlp(x) - MEAN) / STD).
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
# ImageReward.py ``_transform``: Resize(224, BICUBIC) of the shorter side, CenterCrop(224), CLIP's normalization.
IMAGE_SIZE = 224
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageReward.py ``score``: tokenizer(prompt, padding="max_length", truncation=True, max_length=35).
MAX_LENGTH = 35

_VISION, _TEXT, _MLP = "blip.visual_encoder.", "blip.text_encoder.", "mlp."
IGNORED_KEYS = frozenset(
    {
        # BLIP_Pretrain's contrastive projections: BLIPScore uses them, ImageReward's score never does.
        "blip.vision_proj.weight",
        "blip.vision_proj.bias",
        "blip.text_proj.weight",
        "blip.text_proj.bias",
        # med.py registers the position index as a persistent buffer; transformers rebuilds it (non-persistent).
        "blip.text_encoder.embeddings.position_ids",
    }
)
"""Checkpoint keys that hold nothing ImageReward's score reads."""

# timm's ViT (BLIP's vit.py) -> BlipVisionModel, as transformers' BLIP conversion script renames them.
_VISION_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")


def _vision_key(name: str) -> str | None:
    """BlipVisionModel's name for the ViT tensor ``name`` (without ``blip.visual_encoder.``), None if unknown."""
    if name in _VISION_TOP:
        return _VISION_TOP[name]
    found = _BLOCK.fullmatch(name)
    if found is None or found.group(2) not in _VISION_BLOCK:
        return None
    return f"encoder.layers.{found.group(1)}.{_VISION_BLOCK[found.group(2)]}.{found.group(3)}"


def imagereward_to_transformers(
    state: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """An ImageReward checkpoint (BLIP's original layout) as (BlipVisionModel, BlipTextModel, head) state dicts.

    The ViT is renamed; the text encoder keeps its names (BlipTextModel was ported from the same ``med.py``);
    the head drops its ``mlp.`` prefix (AestheticMLP's ``layers.{0,2,4,6,7}``). Only :data:`IGNORED_KEYS` may
    be left over: any other key is an error, so a checkpoint of another layout never loads half-converted.
    """
    vision: dict[str, Tensor] = {}
    text: dict[str, Tensor] = {}
    mlp: dict[str, Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key in IGNORED_KEYS:
            continue
        if key.startswith(_VISION) and (name := _vision_key(key.removeprefix(_VISION))) is not None:
            vision[name] = value
        elif key.startswith(_TEXT):
            text[key.removeprefix(_TEXT)] = value
        elif key.startswith(f"{_MLP}layers."):
            mlp[key.removeprefix(_MLP)] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"reward 'imagereward': the checkpoint has keys outside ImageReward's layout: {sorted(unknown)[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    empty = [
        part
        for part, found in (("blip.visual_encoder", vision), ("blip.text_encoder", text), ("mlp", mlp))
        if not found
    ]
    if empty:
        raise ValueError(f"reward 'imagereward': the checkpoint has no {', '.join(empty)} tensors; is it {WHERE}?")
    return vision, text, mlp


def imagereward_blip_config() -> BlipConfig:
    """ImageReward-v1.0's architecture as a ``transformers`` BlipConfig.

    The vision side is ``create_vit("large", 224)`` (blip.py, vit.py: ViT-L/16, 24 blocks of 16 heads, MLP
    ratio 4, LayerNorm eps 1e-6, exact GELU); the text side is ``med_config.json`` (BERT-base, 12 layers of 12
    heads, vocabulary 30524 with ``[DEC]`` and ``[ENC]``) with ``encoder_width`` set to the ViT's 1024.
    ``is_decoder`` only makes BlipTextModel build its cross-attention (med.py's ``add_cross_attention``): the
    reward calls it as an encoder, with bidirectional self-attention.
    """
    from transformers import BlipConfig

    vision = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16}
    vision |= {"image_size": IMAGE_SIZE, "patch_size": 16, "hidden_act": "gelu", "layer_norm_eps": 1e-6}
    text = {"vocab_size": 30524, "hidden_size": 768, "encoder_hidden_size": 1024, "intermediate_size": 3072}
    text |= {"num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 512}
    text |= {"hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0, "is_decoder": True}
    return BlipConfig(text_config=text, vision_config=vision)


def resize_and_crop(image: Image.Image, size: int) -> Image.Image:
    """torchvision's ``Resize(size, BICUBIC)`` then ``CenterCrop(size)`` on a PIL image, as ImageReward's
    ``_transform`` runs them: the shorter side to ``size`` (the longer one truncated, PIL's antialiased
    bicubic), then the centre ``size`` x ``size`` (offsets rounded half to even, as torchvision does)."""
    w, h = image.size
    short, long = min(w, h), max(w, h)
    new_long = int(size * long / short)
    new = (size, new_long) if w <= h else (new_long, size)
    if new != (w, h):
        image = image.resize(new, Image.Resampling.BICUBIC)
    top, left = int(round((new[1] - size) / 2.0)), int(round((new[0] - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


class ImageRewardModel(nn.Module):
    """ImageReward's three parts: BLIP's ViT, its text encoder with cross-attention, and the reward head."""

    def __init__(self, config: BlipConfig, vision_model: nn.Module, text_encoder: nn.Module, mlp: AestheticMLP) -> None:
        super().__init__()
        self.config = config
        self.vision_model, self.text_encoder, self.mlp = vision_model, text_encoder, mlp


class ImageReward(CLIPReward):
    """ImageReward-v1.0 (Xu et al. 2023): BLIP's text encoder reads the prompt while cross-attending to the
    image's ViT tokens; an MLP on its first ([CLS]) hidden state gives the reward, normalized as the reference
    does: ``(mlp(h_cls) - 0.16717) / 1.03334`` (the reference's constants; higher is better).

    Args:
        pretrained_path: ``ImageReward.pt``, a folder holding ``checkpoint_file``, or the hub id ``THUDM/ImageReward``.
        checkpoint_file: The file inside a folder or hub repo.
        tokenizer_path: bert-base-uncased's tokenizer (a folder with its ``vocab.txt``, or a hub id);
            ``[DEC]`` and ``[ENC]`` are added to it as BLIP's ``init_tokenizer`` does.
        blip_config_path: A transformers BlipConfig (folder with ``config.json``) for another BLIP size;
            None builds ImageReward-v1.0's (:func:`imagereward_blip_config`).
        **kwargs: :class:`CLIPReward`'s prompt, batch_size, device, dtype, frame_stride, frame_reduce.
    """

    name = "imagereward"

    def __init__(
        self,
        pretrained_path: str = HUB_ID,
        checkpoint_file: str = CHECKPOINT_FILE,
        tokenizer_path: str = "bert-base-uncased",
        blip_config_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.checkpoint_file, self.blip_config_path = checkpoint_file, blip_config_path
        super().__init__(pretrained_path, tokenizer_path, **kwargs)

    def _checkpoint(self) -> str:
        return checkpoint_path(self.name, self.pretrained_path, self.checkpoint_file, WHERE)

    def load(self) -> tuple[ImageRewardModel, BertTokenizer]:
        from transformers import BertTokenizer, BlipConfig, BlipTextModel, BlipVisionModel

        tokenizer = load_or_explain(
            self.name,
            "BERT tokenizer (tokenizer_path; bert-base-uncased's vocab.txt)",
            self.processor_path,
            lambda: BertTokenizer.from_pretrained(self.processor_path),
        )
        # blip.py ``init_tokenizer``: only text that spells them out tokenizes differently, but keep it exact.
        tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        config = imagereward_blip_config()
        if self.blip_config_path is not None:
            path = self.blip_config_path
            config = load_or_explain(
                self.name, "BLIP config (blip_config_path)", path, lambda: BlipConfig.from_pretrained(path)
            )
        if len(tokenizer) > config.text_config.vocab_size:
            raise ValueError(
                f"reward 'imagereward': the tokenizer at {self.processor_path!r} has {len(tokenizer)} tokens but the "
                f"text encoder embeds {config.text_config.vocab_size}: use bert-base-uncased's tokenizer"
            )
        vision, text, head = imagereward_to_transformers(
            load_state_dict_file(self.name, "checkpoint", self._checkpoint())
        )
        # Built on the meta device: initializing ViT-L and BERT at random costs seconds only to be overwritten.
        with torch.device("meta"):
            vision_model = BlipVisionModel(config.vision_config)
            text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        mlp = AestheticMLP(config.text_config.hidden_size)
        try:
            vision_model.load_state_dict(vision, strict=True, assign=True)
            text_encoder.load_state_dict(text, strict=True, assign=True)
            mlp.load_state_dict(head, strict=True)
        except RuntimeError as err:
            detail = " ".join(str(err).split())  # torch's message spans lines; an error here is one line
            raise ValueError(f"reward 'imagereward': the checkpoint does not fit the BLIP config: {detail}") from err
        embeddings = text_encoder.embeddings  # the one tensor the checkpoint does not give (non-persistent)
        n = embeddings.position_embeddings.weight.shape[0]
        embeddings.register_buffer("position_ids", torch.arange(n).expand((1, -1)), persistent=False)
        # The head stays float32: the reference casts the [CLS] state to float before it.
        model = ImageRewardModel(config, vision_model.to(self.dtype), text_encoder.to(self.dtype), mlp.float())
        return model, tokenizer

    def pixels(self, images: Tensor) -> Tensor:
        """ImageReward's ``_transform`` on the 8-bit images: shorter side to the ViT's size (PIL bicubic),
        centre crop, CLIP's normalization; float32 on the CPU."""
        size = self.model.config.vision_config.image_size
        arrays = quantize(images).permute(0, 2, 3, 1).cpu().numpy()
        crops = [np.asarray(resize_and_crop(Image.fromarray(a), size)) for a in arrays]
        x = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).float() / 255
        return (x - torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGE_STD).view(1, 3, 1, 1)

    @torch.no_grad()
    def score_images(self, images: Tensor, texts: list[str]) -> Tensor:
        """(N,) float32 CPU rewards of images (N, 3, H, W) against ``texts``, ``batch_size`` pairs a forward.

        The prompt's [CLS] token stays first (ImageReward.score does not swap in ``[ENC]`` as BLIP's ITM head
        does), and the image tokens are not masked: a None cross-attention mask adds the same zeros as the
        reference's all-ones ``image_atts``.
        """
        device = self._place(images)
        order, index = unique_texts(texts)
        tokens = self.processor(
            order, padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        ids, mask = tokens["input_ids"][index].to(device), tokens["attention_mask"][index].to(device)
        out = []
        for lo in range(0, images.shape[0], self.batch_size):
            hi = lo + self.batch_size
            pixels = self.pixels(images[lo:hi]).to(device=device, dtype=self.dtype)
            image_embeds = self.model.vision_model(pixel_values=pixels).last_hidden_state
            hidden = self.model.text_encoder(
                input_ids=ids[lo:hi], attention_mask=mask[lo:hi], encoder_hidden_states=image_embeds
            ).last_hidden_state
            out.append((self.model.mlp(hidden[:, 0].float()) - REWARD_MEAN) / REWARD_STD)
        return torch.cat(out).float().cpu()
