"""The VLM prompt-refiner: an image-text-to-text model (Qwen2.5-VL, Qwen3-VL) used as a text refiner.

PromptRL refines prompts with Qwen2.5-VL. For text-to-image the refiner reads text only, so everything the
causal-LM refiner does (chat format, KV-cache decode, per-token log-probs, the C2 gate) applies unchanged;
what differs is how the model loads and what trains. ``transformers`` has no causal-LM class for these
model types: they load through ``AutoModelForImageTextToText``. Their processors need torchvision (absent
here, and its CUDA-only wheels break ``transformers`` when installed beside a CPU torch), so the tokenizer
and its chat template are loaded alone and the image processor, when asked for, on its PIL backend.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import cached_file

from unirl_pl.experts.chat import ChatFormat
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
    """Prompt-refiner expert over an image-text-to-text checkpoint (Qwen2.5-VL, Qwen3-VL), text-only.

    It is :class:`~unirl_pl.experts.llm.CausalLMExpert` (chat format, stop tokens, reply parsing, adapter
    save/load) with a VLM inside: ``build()`` loads the model with ``AutoModelForImageTextToText`` and the
    tokenizer (with its chat template) from ``pretrained_path``, never the multimodal processor. LoRA goes on
    the language model only; the vision tower is frozen, kept in eval mode and in no optimizer, under LoRA
    and under full fine-tuning alike (full: the language model and ``lm_head`` train).

    Text-only positions: both the KV-cache decode and the teacher-forced re-score pass the same 2-D position
    ids (counted from each row's first real token), which the model expands to its three RoPE sections; a
    call without them gets the same ids here rather than the model's own, which would add a ``rope_deltas``
    cached by an earlier image call.

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
            ``image_processor``, for refiners that will see a source image; text-to-image does not need it.
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
    ) -> None:
        super().__init__(pretrained_path, lora_rank, lora_alpha, lora_target_modules, dtype, init_seed, chat, finetune)
        if not isinstance(load_image_processor, bool):
            raise ValueError(f"load_image_processor must be true or false, got {load_image_processor!r}")
        self.load_image_processor = load_image_processor
        self.image_processor: Any = None

    def build(self) -> None:
        """The causal-LM refiner's ``build()`` (tokenizer, model made trainable as ``finetune`` says), then the
        image processor when asked for, and the vision tower put in eval mode; a second call is a no-op."""
        if self.is_built:
            return
        super().build()
        if self.load_image_processor:
            self.image_processor = AutoImageProcessor.from_pretrained(self.pretrained_path)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: object | None = None,
        use_cache: bool = False,
    ) -> CausalLMOutputWithPast:
        """The causal-LM refiner's forward with text-only position ids filled in when none are given (a call
        without a cache; with one, the caller must pass the positions of the new tokens, as the decode loop
        does)."""
        if position_ids is None and past_key_values is None:
            position_ids = text_positions(attention_mask)
        return super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
