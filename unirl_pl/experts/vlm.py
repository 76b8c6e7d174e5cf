"""The VLM prompt-refiner: an image-text-to-text model (Qwen2.5-VL, Qwen3-VL) used as a prompt refiner.

PromptRL refines prompts with Qwen2.5-VL. For text-to-image the refiner reads text only, so everything the
causal-LM refiner does (chat format, KV-cache decode, per-token log-probs, the C2 gate) applies unchanged;
what differs is how the model loads and what trains. ``transformers`` has no causal-LM class for these
model types: they load through ``AutoModelForImageTextToText``. Their processors need torchvision (absent
here, and its CUDA-only wheels break ``transformers`` when installed beside a CPU torch), so the tokenizer
and its chat template are loaded alone and the image processor, when asked for, on its PIL backend.

For editing the refiner also sees the source image (PromptRL's edit trainer): a row with an image is asked
with the image placeholder of the chat template before the instruction, expanded to the image's token count
as the checkpoint's processor does, and the model reads the image processor's ``pixel_values`` at
multimodal RoPE positions from the model's own ``get_rope_index``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import cached_file

from unirl_pl.experts.chat import ChatFormat, format_requests, user_message
from unirl_pl.experts.finetune import Finetune
from unirl_pl.experts.llm import CausalLMExpert

# Where each VLM layout keeps its vision tower: transformers 5 nests it in the inner ``model``; older
# layouts (and other families) hold it on the top-level model.
_VISION_TOWER_PATHS: tuple[str, ...] = ("model.visual", "visual", "model.vision_tower", "vision_tower")
# peft matches a string ``exclude_modules`` with ``re.fullmatch`` on each module's dotted name: nothing under
# a vision tower gets an adapter, whatever ``lora_target_modules`` names (its attention is ``qkv``/``proj``
# today, but a user list such as ``[qkv, gate_proj]`` must not reach it either).
_VISION_EXCLUDE = r"(.*\.)?(visual|vision_tower)(\..*)?"


def text_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded text-only batch: counting starts at each row's first real token.

    For text-only input the multimodal RoPE of Qwen-VL reduces to 1-D RoPE (its three sections share one
    position and ``rope_deltas`` is 0), so these 2-D ids are exactly what ``get_rope_index`` would give.
    """
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def source_image_pil(image: torch.Tensor) -> Image.Image:
    """The RGB ``PIL`` image of a (3, H, W) float tensor in [0, 1], each value rounded to the nearest 8-bit level.

    The image processor's PIL backend resizes in 8 bits whatever it is given (a float array is truncated to
    ``uint8`` on the way into PIL), so handing it the 8-bit image is what it would read from the image file:
    exact, with ``do_rescale`` then dividing by 255 as for any file, for a tensor that is ``uint8 / 255``.
    Raises ``ValueError`` for anything but a finite float (3, H, W) tensor in [0, 1].
    """
    if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[0] != 3 or not image.is_floating_point():
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"a source image must be a float (3, H, W) tensor in [0, 1], got {shape}")
    pixels = image.detach().float().cpu()
    if not bool(torch.isfinite(pixels).all()) or float(pixels.min()) < 0.0 or float(pixels.max()) > 1.0:
        raise ValueError("a source image must hold finite values in [0, 1]")
    levels = (pixels * 255.0).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
    return Image.fromarray(levels, mode="RGB")


def expand_image_tokens(text: str, image_token: str, counts: Sequence[int]) -> str:
    """``text`` with its ``image_token`` placeholders expanded in order, the i-th into ``counts[i]`` tokens, as
    the Qwen-VL processors do (``prod(image_grid_thw) // merge_size**2`` each). Raises ``ValueError`` when the
    text holds another number of placeholders than there are counts."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"the request holds {len(parts) - 1} {image_token} placeholders for {len(counts)} images")
    out = parts[0]
    for count, part in zip(counts, parts[1:], strict=True):
        out += image_token * int(count) + part
    return out


def vision_tower(model: Any) -> torch.nn.Module | None:
    """The vision encoder of a (possibly peft-wrapped) image-text-to-text ``model``, or None without one."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    for path in _VISION_TOWER_PATHS:
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    return None


def _processor_chat_template(path: str) -> str | None:
    """The chat template a checkpoint ships for its processor (``chat_template.json`` or ``.jinja``), for a
    tokenizer saved without one: some VLM checkpoints keep the template only beside the processor."""
    for name in ("chat_template.jinja", "chat_template.json"):
        file = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        if file is None:
            continue
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
        return text if name.endswith(".jinja") else json.loads(text).get("chat_template")
    return None


class VLMRefinerExpert(CausalLMExpert):
    """Prompt-refiner expert over an image-text-to-text checkpoint (Qwen2.5-VL, Qwen3-VL).

    It is :class:`~unirl_pl.experts.llm.CausalLMExpert` (chat format, stop tokens, reply parsing, adapter
    save/load) with a VLM inside: ``build()`` loads the model with ``AutoModelForImageTextToText`` and the
    tokenizer (with its chat template) from ``pretrained_path``, never the multimodal processor. LoRA goes on
    the language model only; the vision tower is frozen, kept in eval mode and in no optimizer, under LoRA
    and under full fine-tuning alike (full: the language model and ``lm_head`` train).

    Text-only positions: both the KV-cache decode and the teacher-forced re-score pass the same 2-D position
    ids (counted from each row's first real token), which the model expands to its three RoPE sections; a
    call without them gets the same ids here rather than the model's own, which would add a ``rope_deltas``
    cached by an earlier image call.

    Source images (editing; needs ``load_image_processor``): :meth:`tokenize_requests` given a row's image
    renders the user turn as the chat template does for ``[{"type": "image"}, {"type": "text", ...}]`` (the
    image placeholder before the instruction, as PromptRL asks), expands the placeholder to the image's token
    count and returns each row's ``pixel_values`` and ``image_grid_thw``; :meth:`rope_positions` gives the
    (3, B, L) multimodal positions of such a left-padded batch, from the model's own ``get_rope_index``.

    Args:
        pretrained_path: Local folder or hub id of a Qwen2.5-VL or Qwen3-VL checkpoint (with its tokenizer).
        lora_rank: LoRA rank ``r`` (>= 1).
        lora_alpha: LoRA scaling numerator; the adapter output is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: Module names that get LoRA; default the language model's ``q_proj k_proj v_proj
            o_proj``. Nothing under the vision tower is adapted whatever is listed.
        dtype: Dtype of the base weights: ``float32``, ``bfloat16`` or ``float16`` (LoRA weights, and with
            ``finetune: full`` every trained weight, are float32).
        init_seed: Seed of the LoRA init.
        chat: How the refiner is asked and its reply read back (chat template, instruction, ``answer_tag``
            for PromptRL's ``<answer>`` replies); None feeds the bare prompt and takes the continuation.
        finetune: ``lora`` (an adapter on the frozen model; the reference is the adapter bypassed) or ``full``
            (the language model and ``lm_head`` train, the vision tower stays frozen; the reference is a
            frozen copy), PromptRL's setting.
        load_image_processor: Also load the checkpoint's image processor (PIL backend, no torchvision) as
            ``image_processor``, so the refiner sees each sample's source image (editing); text-to-image does
            not need it.
        image_min_pixels: Lower bound on an image's pixel count after the processor's resize (its
            ``min_pixels``, ``size.shortest_edge``); None keeps the checkpoint's. PromptRL's editing: 200704
            (448 x 448, 256 image tokens for Qwen2.5-VL). Needs ``load_image_processor``.
        image_max_pixels: Upper bound on an image's pixel count after the resize (``max_pixels``,
            ``size.longest_edge``); None keeps the checkpoint's. PromptRL's editing: 200704. Needs
            ``load_image_processor``.
    """

    # No causal-LM class loads these model types; ``build()`` and ``plan`` both go through this one.
    auto_model_class: ClassVar[Any] = AutoModelForImageTextToText

    def __init__(
        self,
        pretrained_path: str,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        dtype: str = "float32",
        init_seed: int = 0,
        chat: ChatFormat | None = None,
        finetune: Finetune = "lora",
        load_image_processor: bool = False,
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        super().__init__(pretrained_path, lora_rank, lora_alpha, lora_target_modules, dtype, init_seed, chat, finetune)
        if not isinstance(load_image_processor, bool):
            raise ValueError(f"load_image_processor must be true or false, got {load_image_processor!r}")
        for name, value in (("image_min_pixels", image_min_pixels), ("image_max_pixels", image_max_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")
            if value is not None and not load_image_processor:
                raise ValueError(f"{name} bounds the image processor's resize: set load_image_processor: true")
        if image_min_pixels is not None and image_max_pixels is not None and image_min_pixels > image_max_pixels:
            raise ValueError(f"image_min_pixels ({image_min_pixels}) exceeds image_max_pixels ({image_max_pixels})")
        self.load_image_processor = load_image_processor
        self.image_min_pixels, self.image_max_pixels = image_min_pixels, image_max_pixels
        self.image_processor: Any = None

    def build(self) -> None:
        """The causal-LM refiner's ``build()`` (tokenizer, model made trainable as ``finetune`` says), then the
        image processor when asked for, and the vision tower put in eval mode; a second call is a no-op."""
        if self.is_built:
            return
        super().build()
        if self.load_image_processor:
            bounds = {"min_pixels": self.image_min_pixels, "max_pixels": self.image_max_pixels}
            bounds = {k: v for k, v in bounds.items() if v is not None}
            self.image_processor = AutoImageProcessor.from_pretrained(self.pretrained_path, **bounds)
        self.train(self.training)  # the vision tower into eval mode

    def _base_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        base = super()._base_model(tokenizer)
        if vision_tower(base) is None:
            raise ValueError(
                f"{type(self).__name__}: {type(base).__name__} from {self.pretrained_path!r} has no vision "
                "tower at any of " + ", ".join(_VISION_TOWER_PATHS) + "; use CausalLMExpert for a text-only LM"
            )
        return base

    def _build_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = super()._build_tokenizer()
        if getattr(tokenizer, "chat_template", None) is None:
            assert self.pretrained_path is not None
            tokenizer.chat_template = _processor_chat_template(self.pretrained_path)
        return tokenizer

    def lora_config(self) -> Any:
        """The causal-LM refiner's ``LoraConfig`` with every module under the vision tower excluded."""
        config = super().lora_config()
        config.exclude_modules = _VISION_EXCLUDE
        return config

    def frozen_submodules(self, model: Any) -> list[torch.nn.Module]:
        """The vision tower: full fine-tuning trains the language model and ``lm_head``, never the encoder
        of images a text-to-image refiner does not see (PromptRL freezes it too)."""
        tower = vision_tower(model)
        return [] if tower is None else [tower]

    def train(self, mode: bool = True) -> VLMRefinerExpert:
        """Switch the model to ``mode``; the frozen vision tower stays in eval mode."""
        super().train(mode)
        if self.model is not None:
            tower = vision_tower(self.model)
            if tower is not None:
                tower.eval()
        return self

    @property
    def sees_images(self) -> bool:
        """Whether a request may carry a source image: the image processor is loaded (``load_image_processor``)."""
        return self.load_image_processor

    @property
    def image_token(self) -> str:
        """The placeholder token the image's features replace (``<|image_pad|>``), from the model's config."""
        model = self._require_built()
        return str(self._require_tokenizer().convert_ids_to_tokens(int(model.config.image_token_id)))

    def prepare_image(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values, image_grid_thw)`` of one source image, a (3, H, W) float tensor in [0, 1]: the image
        processor's output for the 8-bit RGB image (:func:`source_image_pil`), alone, so it does not depend on
        the batch; ``pixel_values`` (patches, C * T * P * P) float32 and ``image_grid_thw`` (3,) long."""
        self._require_sees_images()
        out = self.image_processor(images=[source_image_pil(image)], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"][0].long()

    def image_token_count(self, grid: torch.Tensor) -> int:
        """How many placeholder tokens an image of grid ``(t, h, w)`` takes: ``t * h * w // merge_size**2``."""
        return int(grid.prod()) // int(self.image_processor.merge_size) ** 2

    def tokenize_requests(
        self, prompts: list[str], images: Sequence[torch.Tensor | None] | None = None
    ) -> dict[str, Any]:
        """The causal-LM refiner's left-padded ``input_ids``/``attention_mask``, rows with a source image asked
        with it.

        ``images`` (aligned with ``prompts``; None or all-None: the text-only requests, unchanged) holds a
        (3, H, W) float tensor in [0, 1] or None per row. A row with an image renders its user turn as the
        chat template does for ``[{"type": "image"}, {"type": "text", "text": <instruction>}]``, with each
        image placeholder expanded to the image's token count as the processor does; a row without one is
        exactly its text-only request. With images the result also holds ``pixel_values`` and
        ``image_grid_thw``: per row, the image's patches and (3,) grid, or None (one image object given to
        several rows is preprocessed once and its tensors shared).
        """
        if images is None or all(image is None for image in images):
            return super().tokenize_requests(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} source images for {len(prompts)} prompts")
        self._require_sees_images()
        chat = self.chat
        if chat is None or not chat.use_chat_template:
            raise ValueError(
                f"{type(self).__name__}: a source image needs the chat template's image placeholder: "
                "set chat.use_chat_template: true"
            )
        tokenizer = self._require_tokenizer()
        token = self.image_token
        prepared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        texts, pixel_values, grids = [], [], []
        for prompt, image in zip(prompts, images, strict=True):
            if image is None:
                texts.append(format_requests(tokenizer, [prompt], chat)[0])
                pixel_values.append(None)
                grids.append(None)
                continue
            if id(image) not in prepared:
                prepared[id(image)] = self.prepare_image(image)
            pixels, grid = prepared[id(image)]
            messages = [] if chat.system_prompt is None else [{"role": "system", "content": chat.system_prompt}]
            content = [{"type": "image"}, {"type": "text", "text": user_message(prompt, chat)}]
            messages.append({"role": "user", "content": content})
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=chat.enable_thinking
            )
            texts.append(expand_image_tokens(text, token, [self.image_token_count(grid)]))
            pixel_values.append(pixels)
            grids.append(grid)
        enc = dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))
        return enc | {"pixel_values": pixel_values, "image_grid_thw": grids}

    def rope_positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """The (3, B, L) multimodal RoPE positions of a left-padded request batch, from the model's own
        ``get_rope_index``: each image's tokens at their (t, h, w) grid positions, text after it continuing
        from the image's largest position + 1, padding at 0. ``image_grid_thw`` (images, 3) holds the grids
        of the batch's images in row order (None without images: the text positions on all three sections).
        Every ``image_token`` of ``input_ids`` is an image's placeholder, so only the requests (no generated
        tokens) may be passed; the generated tokens continue each row from its last position + 1."""
        if image_grid_thw is None:
            return text_positions(attention_mask)[None].expand(3, -1, -1)
        model = self._require_built()
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner = inner.model if hasattr(getattr(inner, "model", None), "get_rope_index") else inner
        types = (input_ids == int(model.config.image_token_id)) & attention_mask.bool()
        positions, _ = inner.get_rope_index(
            input_ids,
            mm_token_type_ids=types.int(),
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask,
        )
        return positions

    def _require_sees_images(self) -> None:
        if not self.load_image_processor:
            raise ValueError(
                f"{type(self).__name__} was given a source image but has no image processor: "
                "set load_image_processor: true for the refiner to see source images"
            )
        if self.image_processor is None:
            raise RuntimeError(f"{type(self).__name__}.build() has not run: its image processor is not loaded")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: object | None = None,
        use_cache: bool = False,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> CausalLMOutputWithPast:
        """The causal-LM refiner's forward with text-only position ids filled in when none are given (a call
        without a cache; with one, the caller must pass the positions of the new tokens, as the decode loop
        does). With ``pixel_values`` (the batch's images' patches, in row order) and ``image_grid_thw``
        (images, 3) the images' features replace the ``image_token`` placeholders of ``input_ids``; positions
        default to :meth:`rope_positions` then."""
        if pixel_values is None:
            if position_ids is None and past_key_values is None:
                position_ids = text_positions(attention_mask)
            return super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        if position_ids is None:
            if past_key_values is not None:
                raise ValueError("a cached forward with images needs the position ids of its new tokens")
            position_ids = self.rope_positions(input_ids, attention_mask, image_grid_thw)
        return self._call_model(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values,
            use_cache,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        )
