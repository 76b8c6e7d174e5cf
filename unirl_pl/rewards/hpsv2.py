"""HPSv2 / HPSv2.1 in process: the open_clip checkpoint converted into a ``transformers`` CLIPModel.

Neither the ``hpsv2`` package (it pins pytest 7.2 and protobuf 3.20) nor ``open_clip`` (it needs a
torchvision that matches the installed torch) is needed: the checkpoint's tensors are renamed into
CLIPModel's layout and scored with :class:`unirl_pl.rewards.clip_models.CLIPReward`'s machinery.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from unirl_pl.rewards.clip_models import CLIPReward, quantize
from unirl_pl.rewards.loading import checkpoint_path, load_or_explain, load_state_dict_file


def open_clip_to_transformers(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An open_clip CLIP state dict (``visual.*``, ``transformer.*``, ``token_embedding``, ...) renamed
    and reshaped into ``transformers``' CLIPModel layout.

    open_clip keeps each attention's q/k/v as one ``in_proj`` matrix (nn.MultiheadAttention) and the
    projections as (width, embed) matrices applied on the right; CLIPModel has separate q/k/v Linears
    and Linear projections, so the former are split in three and the latter transposed.
    """
    out: dict[str, Tensor] = {}

    def block(src: str, dst: str) -> None:
        qkv_w, qkv_b = state[f"{src}.attn.in_proj_weight"], state[f"{src}.attn.in_proj_bias"]
        for name, w, b in zip(("q", "k", "v"), qkv_w.chunk(3), qkv_b.chunk(3), strict=True):
            out[f"{dst}.self_attn.{name}_proj.weight"], out[f"{dst}.self_attn.{name}_proj.bias"] = w, b
        pairs = {
            "attn.out_proj": "self_attn.out_proj",
            "ln_1": "layer_norm1",
            "ln_2": "layer_norm2",
            "mlp.c_fc": "mlp.fc1",
            "mlp.c_proj": "mlp.fc2",
        }
        for a, b_ in pairs.items():
            for p in ("weight", "bias"):
                out[f"{dst}.{b_}.{p}"] = state[f"{src}.{a}.{p}"]

    def layers(prefix: str) -> int:
        head = f"{prefix}transformer.resblocks."
        return len({k[len(head) :].split(".")[0] for k in state if k.startswith(head)})

    for i in range(layers("visual.")):
        block(f"visual.transformer.resblocks.{i}", f"vision_model.encoder.layers.{i}")
    for i in range(layers("")):
        block(f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}")
    out["vision_model.embeddings.patch_embedding.weight"] = state["visual.conv1.weight"]
    out["vision_model.embeddings.class_embedding"] = state["visual.class_embedding"]
    out["vision_model.embeddings.position_embedding.weight"] = state["visual.positional_embedding"]
    for p in ("weight", "bias"):
        out[f"vision_model.pre_layrnorm.{p}"] = state[f"visual.ln_pre.{p}"]
        out[f"vision_model.post_layernorm.{p}"] = state[f"visual.ln_post.{p}"]
        out[f"text_model.final_layer_norm.{p}"] = state[f"ln_final.{p}"]
    out["visual_projection.weight"] = state["visual.proj"].t().contiguous()
    out["text_projection.weight"] = state["text_projection"].t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = state["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = state["positional_embedding"]
    out["logit_scale"] = state["logit_scale"].reshape(())
    return out


class HPSv2(CLIPReward):
    """HPSv2 / HPSv2.1 (Wu et al. 2023): the cosine of the normalized image and text embeddings of an
    open_clip ViT-H/14 fine-tuned on human preferences (scores around 0.2-0.3).

    The checkpoint (``HPS_v2.1_compressed.pt``, open_clip's layout) is converted into a ``transformers``
    CLIPModel built from ``clip_path``'s config (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, whose
    tokenizer is the same BPE as open_clip's), so neither ``hpsv2`` nor ``open_clip`` is needed. Images
    go through HPSv2's own evaluation transform: the longer side resized to the model's input size
    (bicubic, antialiased), the shorter one zero-padded to a square, then normalized.

    Args:
        pretrained_path: The checkpoint file, a folder holding ``checkpoint_file``, or a hub id (``xswu/HPSv2``).
        checkpoint_file: The file inside a folder or hub repo: ``HPS_v2.1_compressed.pt`` or ``HPS_v2_compressed.pt``.
        clip_path: The CLIP config and tokenizer (folder or hub id).
        **kwargs: :class:`CLIPReward`'s prompt, batch_size, device, dtype, frame_stride, frame_reduce.
    """

    name = "hpsv2"

    def __init__(
        self,
        pretrained_path: str = "xswu/HPSv2",
        checkpoint_file: str = "HPS_v2.1_compressed.pt",
        clip_path: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        **kwargs: Any,
    ) -> None:
        self.checkpoint_file = checkpoint_file
        super().__init__(pretrained_path, clip_path, **kwargs)

    def _checkpoint(self) -> str:
        return checkpoint_path(
            self.name, self.pretrained_path, self.checkpoint_file, "released in the hub repo xswu/HPSv2"
        )

    def load(self) -> tuple[Any, Any]:
        from transformers import CLIPConfig, CLIPModel, CLIPProcessor

        processor = load_or_explain(
            self.name,
            "CLIP processor (clip_path)",
            self.processor_path,
            lambda: CLIPProcessor.from_pretrained(self.processor_path),
        )
        config = load_or_explain(
            self.name,
            "CLIP config (clip_path)",
            self.processor_path,
            lambda: CLIPConfig.from_pretrained(self.processor_path),
        )
        state = open_clip_to_transformers(load_state_dict_file(self.name, "checkpoint", self._checkpoint()))
        # Built on the meta device: random initialization of a ViT-H would cost many seconds only to be
        # overwritten; the non-persistent position ids are the one thing the checkpoint does not hold.
        with torch.device("meta"):
            model = CLIPModel(config)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as err:
            raise ValueError(
                f"reward 'hpsv2': the checkpoint does not fit the CLIP config at {self.processor_path!r}: {err}"
            ) from err
        for module in (model.vision_model.embeddings, model.text_model.embeddings):
            n = module.position_embedding.weight.shape[0]
            module.register_buffer("position_ids", torch.arange(n).expand((1, -1)), persistent=False)
        return model.to(self.dtype), processor

    def pixels(self, images: Tensor) -> Tensor:
        """HPSv2's evaluation transform on the 8-bit images, in torch (on the images' device)."""
        size = self.model.config.vision_config.image_size
        x = quantize(images).float() / 255
        h, w = x.shape[-2:]
        scale = size / max(h, w)
        if scale != 1.0:
            nh, nw = round(h * scale), round(w * scale)
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
            ph, pw = size - nh, size - nw
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)
        ip = self.processor.image_processor
        mean = torch.tensor(ip.image_mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(ip.image_std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def score_embeddings(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        return (image_emb * text_emb).sum(-1)
