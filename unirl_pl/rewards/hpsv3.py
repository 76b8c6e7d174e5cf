"""HPSv3 (Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score") in process, on ``transformers``'
Qwen2-VL.

Reference read (MizzenAI/HPSv3): ``hpsv3/model/qwen2vl_trainer.py`` (the reward model), ``hpsv3/train.py``
(``create_model_and_processor``) and ``hpsv3/config/HPSv3_7B.yaml`` at commit
d232ff8669a0b00759766067c6c3a26e2e717fac, ``hpsv3/inference.py`` at 72b7ebaf0fe76bce636b3f4997aee319d0f65aef,
and the authors' PyPI release ``hpsv3`` 1.0.0 (pinned to transformers 4.45.2) for what that snapshot lacks:
``hpsv3/dataset/data_collator_qwen.py`` (the instruction) and ``hpsv3/dataset/utils.py`` (the resize).

What the reference does, and how it is reproduced here:

- Model: Qwen2-VL-7B-Instruct with one added special token ``<|Reward|>`` (the embeddings resized to the
  tokenizer's new length) and a head ``rm_head`` = Linear(hidden, 1024), ReLU, Dropout(0.05), Linear(1024, 16),
  ReLU, Linear(16, 2) (``rm_head_type: ranknet``, ``output_dim: 2``), kept in float32 while the rest runs in
  bfloat16. Its outputs are the mean ``mu`` and ``log sigma`` of the uncertainty-aware preference loss
  (``loss_type: uncertainty``); the score is ``mu`` (``inference.py``: "we select miu as the final output").
- Input: one user turn of the base model's chat template, with the generation prompt: the image first, then
  ``INSTRUCTION.format(text_prompt=prompt) + prompt_with_special_token``. The image is resized (PIL, bicubic)
  to exactly 256 * 28 * 28 pixels' worth (min = max pixels), rounded to multiples of 28: 256 image tokens.
- Readout: the head on the decoder's final (normed) hidden state at the ``<|Reward|>`` token.
- Positions: the reference's forward embeds the image itself and calls the text decoder without position ids,
  so every token is numbered 0, 1, 2, ... in all three M-RoPE sections (plain 1-D RoPE), not Qwen2-VL's 3-D
  image positions. The checkpoint was trained so; the same positions are passed here.
- Checkpoint: ``HPSv3.safetensors`` (hub repo ``MizzenAI/HPSv3``), the whole model's state dict, in
  transformers 4.45's key layout or 4.52's; both are accepted (:func:`hpsv3_to_transformers`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor, nn

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.clip_models import (
    PromptChoice,
    quantize,
    torch_dtype,
)
from unirl_pl.rewards.loading import checkpoint_path, load_or_explain, load_state_dict_file

REWARD_TOKEN = "<|Reward|>"
# The instruction and the closing line of ``hpsv3/dataset/data_collator_qwen.py`` (``INSTRUCTION`` and
# ``prompt_with_special_token``), character for character: written with explicit newlines so the trailing
# spaces some of its lines carry survive editors and linters.
INSTRUCTION = (
    "\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a "
    "overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the "
    "worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense "
    "of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, "
    "or adult material. If such content is present, the image quality and satisfaction score should be the "
    "lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) "
    "align with the textual description. The subject should match the description in terms of number, "
    "appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well "
    "the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the "
    "image logically fit the scenario described in the prompt. The environment should support and enhance the "
    "subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, "
    "accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be "
    "acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in "
    "the image. The generated content should not introduce elements that conflict with or distort the original "
    "description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
CLOSING = "\nPlease provide the overall ratings of this image: " + REWARD_TOKEN + "\n\nEND\n"
# inference.py's fixed pixel budget (min_pixels = max_pixels = 256 * 28 * 28) and qwen-vl-utils' rounding
# factor (patch 14 x merge 2) and aspect-ratio limit.
PIXELS, FACTOR, MAX_RATIO = 256 * 28 * 28, 28, 200


def hpsv3_text(prompt: str) -> str:
    """The user turn's text for ``prompt``, as the reference writes it."""
    return INSTRUCTION.format(text_prompt=prompt) + CLOSING


def smart_resize(height: int, width: int, pixels: int = PIXELS, factor: int = FACTOR) -> tuple[int, int]:
    """(height, width) the reference resizes an image to: each side rounded to a multiple of ``factor``,
    then, when that is more or fewer than ``pixels`` pixels, both sides scaled by one factor (rounded down
    above the budget, up below it) so the area lands on it. qwen-vl-utils' rule with min = max pixels."""
    if max(height, width) > MAX_RATIO * min(height, width):
        raise ValueError(f"reward 'hpsv3': image aspect ratio over {MAX_RATIO} ({height}x{width})")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def hpsv3_to_transformers(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """An HPSv3 state dict split into (``Qwen2VLModel``'s state dict, the head's ``nn.Sequential`` state dict).

    The reference saves ``Qwen2VLForConditionalGeneration`` plus ``rm_head``: under transformers 4.45 (what
    its release pins) the decoder is ``model.*`` and the vision tower ``visual.*``; from 4.52 on they are
    ``model.language_model.*`` and ``model.visual.*``. ``lm_head.weight`` is dropped: the score never reads
    the vocabulary logits. Any other key, or two keys landing on one name, is an error.
    """
    base: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    for key, value in state.items():
        if key == "lm_head.weight":
            continue
        if key.startswith("rm_head."):
            into, name = head, key.removeprefix("rm_head.")
        elif key.startswith(("model.visual.", "visual.")):
            into, name = base, "visual." + key.split("visual.", 1)[1]
        elif key.startswith("model."):
            into, name = base, "language_model." + key.removeprefix("model.").removeprefix("language_model.")
        else:
            raise ValueError(f"reward 'hpsv3': unexpected checkpoint key {key!r} (not rm_head, model, visual, lm_head)")
        if name in into:
            raise ValueError(f"reward 'hpsv3': checkpoint keys in two layouts both give {name!r} (last: {key!r})")
        into[name] = value
    if not head:
        raise ValueError("reward 'hpsv3': the checkpoint has no rm_head.* keys: it is not an HPSv3 reward model")
    return base, head


def reward_head(hidden_size: int) -> nn.Sequential:
    """The reference's ``ranknet`` head: hidden -> 1024 -> 16 -> (mu, log sigma), in float32."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2)
    )


def _load_strict(module: nn.Module, state: dict[str, Tensor], prefix: str, source: str) -> None:
    """``module.load_state_dict(state, strict=True, assign=True)``, or a ValueError naming the checkpoint's
    missing and unexpected keys (with ``prefix``, as the checkpoint spells them) or its shape mismatches."""
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"reward 'hpsv3': the checkpoint {source!r} does not fit the model built from processor_path's config: "
            f"missing {[prefix + k for k in missing[:6]]} ({len(missing)} in all), "
            f"unexpected {[prefix + k for k in unexpected[:6]]} ({len(unexpected)} in all)"
        )
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:  # a tensor of the wrong shape: another model size than the config's
        raise ValueError(
            f"reward 'hpsv3': the checkpoint {source!r} ({prefix}*) does not fit the config: {err}"
        ) from err


def _rebuild_rotary_buffers(model: nn.Module) -> None:
    """Recompute the rotary tables a model built on the meta device lacks.

    They are non-persistent buffers (no checkpoint holds them) derived from the config alone, so a fresh
    rotary module on the CPU supplies them; any other buffer still on meta is an error.
    """
    for module in model.modules():
        stale = [name for name, buf in module.named_buffers(recurse=False) if buf.is_meta]
        if not stale:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding") or not hasattr(module, "config"):
            raise ValueError(f"reward 'hpsv3': {type(module).__name__} has buffers {stale} no checkpoint holds")
        fresh = type(module)(module.config)
        for name in stale:
            setattr(module, name, getattr(fresh, name))


class HPSv3(Reward):
    """HPSv3: a human preference score from a Qwen2-VL-7B reward model; unbounded, higher is preferred (the
    authors' demo reads below 0 as poor and 10 or more as excellent).

    Args:
        pretrained_path: A folder holding ``checkpoint_file``, the file itself, or the hub id (``MizzenAI/HPSv3``).
        checkpoint_file: The file inside a folder or hub repo.
        processor_path: The base model's folder or hub id (``Qwen/Qwen2-VL-7B-Instruct``): its config, tokenizer
            (with the chat template) and image processor. Its weights are not read.
        prompt: Which text is scored: ``original`` (the user's prompt) or ``refined`` (the rewrite).
        batch_size: Images per forward.
        device: Where the model runs; None follows the images' device.
        dtype: The weights' dtype (bfloat16 as the reference; the head stays float32, scores are float32).
    """

    name = "hpsv3"

    def __init__(
        self,
        pretrained_path: str = "MizzenAI/HPSv3",
        checkpoint_file: str = "HPSv3.safetensors",
        processor_path: str = "Qwen/Qwen2-VL-7B-Instruct",
        prompt: PromptChoice = "original",
        batch_size: int = 8,
        device: str | None = None,
        dtype: str = "bfloat16",
    ) -> None:
        if prompt not in ("original", "refined"):
            raise ValueError(f"reward 'hpsv3': prompt must be 'original' or 'refined', got {prompt!r}")
        if batch_size < 1:
            raise ValueError(f"reward 'hpsv3': batch_size must be >= 1, got {batch_size}")
        self.pretrained_path, self.checkpoint_file = pretrained_path, checkpoint_file
        self.processor_path = processor_path
        self.prompt, self.batch_size = prompt, batch_size
        self.dtype = torch_dtype(self.name, dtype)
        self.load()
        self.device = torch.device(device) if device is not None else None
        if self.device is not None:
            self.model.to(self.device)
            self.head.to(self.device)

    # ------------------------------------------------------------------ loading
    def _checkpoint(self) -> str:
        return checkpoint_path(
            self.name,
            self.pretrained_path,
            self.checkpoint_file,
            "released in the hub repo MizzenAI/HPSv3: huggingface-cli download MizzenAI/HPSv3 "
            f"{self.checkpoint_file} --local-dir <folder>",
        )

    def _chat_template(self) -> str:
        """The base model's chat template: the tokenizer's, else the processor's ``chat_template.json``."""
        if self.tokenizer.chat_template:
            return str(self.tokenizer.chat_template)
        local = Path(self.processor_path) / "chat_template.json"
        if not local.is_file() and not Path(self.processor_path).is_dir():
            from huggingface_hub import hf_hub_download

            local = Path(
                load_or_explain(
                    self.name,
                    "chat template (processor_path)",
                    self.processor_path,
                    lambda: hf_hub_download(self.processor_path, "chat_template.json"),
                )
            )
        if not local.is_file():
            raise ValueError(f"reward 'hpsv3': {self.processor_path!r} has no chat template (Qwen2-VL-7B-Instruct's)")
        return str(json.loads(local.read_text())["chat_template"])

    def load(self) -> None:
        """Tokenizer (plus ``<|Reward|>``), image processor, Qwen2-VL decoder and vision tower, and the head."""
        import transformers
        from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLModel

        if int(transformers.__version__.split(".")[0]) < 5:
            raise ValueError(f"reward 'hpsv3' needs transformers >= 5 (installed: {transformers.__version__})")
        # The PIL image processor, as the reference's transformers 4.45 had: no torchvision needed, and the same
        # pixels whatever else is installed (releases without it name the PIL one Qwen2VLImageProcessor).
        image_processor_cls = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
        what = "Qwen2-VL {} (processor_path: the base model, e.g. Qwen/Qwen2-VL-7B-Instruct)"
        path = self.processor_path
        self.tokenizer = load_or_explain(
            self.name, what.format("tokenizer"), path, lambda: AutoTokenizer.from_pretrained(path)
        )
        self.image_processor = load_or_explain(
            self.name, what.format("image processor"), path, lambda: image_processor_cls.from_pretrained(path)
        )
        config = load_or_explain(self.name, what.format("config"), path, lambda: Qwen2VLConfig.from_pretrained(path))
        self.chat_template = self._chat_template()
        self.tokenizer.padding_side = "right"  # as the reference's processor; the readout does not depend on it
        self.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = int(self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN))
        self.image_token = "<|image_pad|>"
        self.merge = int(self.image_processor.merge_size)

        source = self._checkpoint()
        base, head = hpsv3_to_transformers(load_state_dict_file(self.name, "checkpoint", source))
        rows = base.get("language_model.embed_tokens.weight")
        if rows is not None and rows.shape[0] != len(self.tokenizer):
            # The reference resizes the embeddings to the tokenizer's length after adding <|Reward|>.
            raise ValueError(
                f"reward 'hpsv3': the checkpoint embeds {rows.shape[0]} tokens but the tokenizer at {path!r} has "
                f"{len(self.tokenizer)} with {REWARD_TOKEN}: use the tokenizer HPSv3 was trained with "
                "(Qwen2-VL-7B-Instruct's)"
            )
        config.text_config.vocab_size = len(self.tokenizer)
        config._attn_implementation = "sdpa"  # the reference's (its config disables flash attention)
        # On the meta device: initializing 8B parameters only to overwrite them would take minutes.
        with torch.device("meta"):
            model = Qwen2VLModel(config)
        _load_strict(model, base, "model.", source)
        _rebuild_rotary_buffers(model)
        # Like the reference's model.to(bfloat16), this casts the rotary tables too.
        self.model = model.to(self.dtype).requires_grad_(False).eval()
        self.head = reward_head(config.text_config.hidden_size)
        _load_strict(self.head, head, "rm_head.", source)
        self.head = self.head.float().requires_grad_(False).eval()

    def _place(self, images: Tensor) -> torch.device:
        """The device to score on; the model moves there on first use (a rank's own GPU under DDP)."""
        device = self.device or images.device
        if next(self.model.parameters()).device != device:
            self.model.to(device)
            self.head.to(device)
        return device

    # ------------------------------------------------------------------ inputs
    def texts(self, prompts: list[str]) -> list[str]:
        """The chat-formatted text of each sample, one image placeholder each (before expansion)."""
        out = []
        for prompt in prompts:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(prompt)}]}]
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
            )
            out.append(str(text))
        return out

    def inputs(self, images: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Token ids, attention mask, positions, pixel values and grids of one batch, on the CPU."""
        pil = []
        for array in quantize(images).permute(0, 2, 3, 1).cpu().numpy():
            image = Image.fromarray(array)
            h, w = smart_resize(image.height, image.width)
            pil.append(image.resize((w, h), Image.Resampling.BICUBIC))
        vision = self.image_processor(images=pil, return_tensors="pt")
        texts = []
        for text, grid in zip(self.texts(prompts), vision["image_grid_thw"], strict=True):
            n = int(grid.prod()) // self.merge**2
            texts.append(text.replace(self.image_token, self.image_token * n, 1))
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        mask = tokens["attention_mask"]
        # 0, 1, 2, ... over the real tokens in all three M-RoPE sections: the reference's positions.
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0).unsqueeze(0).expand(3, -1, -1)
        return {
            "input_ids": tokens["input_ids"],
            "attention_mask": mask,
            "position_ids": positions,
            "pixel_values": vision["pixel_values"],
            "image_grid_thw": vision["image_grid_thw"],
        }

    # ------------------------------------------------------------------ scores
    @torch.no_grad()
    def score_images(self, images: Tensor, texts: list[str]) -> Tensor:
        """(N,) float32 CPU scores (``mu``) of images (N, 3, H, W) against ``texts``."""
        device = self._place(images)
        out = []
        for lo in range(0, images.shape[0], self.batch_size):
            batch = self.inputs(images[lo : lo + self.batch_size], texts[lo : lo + self.batch_size])
            ids = batch["input_ids"].to(device)
            hidden = self.model(
                input_ids=ids,
                attention_mask=batch["attention_mask"].to(device),
                position_ids=batch["position_ids"].to(device),
                pixel_values=batch["pixel_values"].to(device, self.dtype),
                image_grid_thw=batch["image_grid_thw"].to(device),
                use_cache=False,
            ).last_hidden_state
            is_reward = ids == self.reward_id
            if not bool(is_reward.any(-1).all()):
                raise ValueError(f"reward 'hpsv3': a sample's tokens lack {REWARD_TOKEN} (truncated?)")
            # The template's <|Reward|> is the last one: a prompt that spells the token itself comes before it.
            where = (is_reward.long() * torch.arange(ids.shape[1], device=device)).argmax(-1)
            picked = hidden[torch.arange(ids.shape[0], device=device), where].float()
            out.append(self.head(picked)[:, 0].cpu())
        return torch.cat(out)

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        texts = list(prompts if self.prompt == "original" else refined_prompts)
        if images.ndim != 4:
            raise ValueError(f"reward 'hpsv3': expected (N, 3, H, W) images, got shape {tuple(images.shape)}")
        if len(texts) != images.shape[0]:
            raise ValueError(f"reward 'hpsv3': {len(texts)} prompts for {images.shape[0]} images")
        return self.score_images(images, texts).tolist()
