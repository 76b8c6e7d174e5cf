"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 / 2511) as a ``FlowGenerator``: Qwen-Image's MMDiT conditioned on
a source image twice, as ``QwenImageEditPlusPipeline`` conditions it: the Qwen2.5-VL text encoder reads the source
(resized to the pipeline's condition size, about 384x384 pixels) inside its prompt template, and the VAE latents of
the source, packed like the target's, follow the noisy target tokens in the DiT's image sequence (their own RoPE
frame, ``img_shapes`` one entry per image); the prediction is sliced back to the target tokens.

Batch invariance, as in :mod:`unirl_pl.generators.qwenimage`: each (prompt, source) pair is encoded alone, its
features right-padded with zeros to the fixed ``max_sequence_length`` with a mask (the text RoPE table starts after
the image grids' and counts the padded width, so a row's positions never depend on its batch, diffusers #12075);
each source image is resized and VAE-encoded alone, at one fixed size for every sample (``source_size``), so
every row of a batch has the same ``img_shapes`` (the DiT's RoPE reads the first row's).

What the pipeline feeds its text encoder is rebuilt from its parts: ``Qwen2VLProcessor`` cannot be built without
torchvision, so the generator loads the processor folder's tokenizer and image processor (``AutoImageProcessor``:
the torchvision backend where it is installed, the PIL one otherwise, as the processor itself would load it) and
expands the template's ``<|image_pad|>`` into ``prod(image_grid_thw) / merge_size**2`` pads as the processor does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import PIL.Image
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    calculate_dimensions,
    retrieve_latents,
)
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from unirl_pl.experts._common import check_positive
from unirl_pl.generators.base import Cond
from unirl_pl.generators.qwenimage import QwenImageGenerator, _pack, _unpack


def _pipeline_constants() -> tuple[str, int]:
    """``QwenImageEditPlusPipeline``'s prompt template and the count of its leading tokens the pipeline drops
    (``prompt_template_encode_start_idx``), read off an empty pipeline so they follow diffusers."""
    empty = QwenImageEditPlusPipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    return empty.prompt_template_encode, empty.prompt_template_encode_start_idx


EDIT_PROMPT_TEMPLATE, EDIT_TEMPLATE_TOKENS = _pipeline_constants()
# ``QwenImageEditPlusPipeline._get_qwen_prompt_embeds``'s per-image label (a local there), put before the prompt.
IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
# The cond keys this family adds: the source's packed VAE latents, the empty prompt's features with the source
# (the pipeline's negative branch), and the marker of the rows that are the empty prompt without the source.
SOURCE_LATENTS, NEGATIVE_HIDDEN, NEGATIVE_MASK, EMPTY_PROMPT = (
    "source_latents",
    "source_negative_hidden",
    "source_negative_mask",
    "empty_prompt",
)


def to_pil(image: Tensor) -> PIL.Image.Image:
    """A (3, H, W) float image in [0, 1] as the RGB PIL image the pipeline takes (diffusers' own conversion:
    ``round(x * 255)``, exact for pixels read from an 8-bit file)."""
    array = VaeImageProcessor.pt_to_numpy(image.detach().float().clamp(0.0, 1.0).unsqueeze(0).cpu())
    return VaeImageProcessor.numpy_to_pil(array)[0]


def _image_key(image: Tensor) -> tuple[tuple[int, ...], str]:
    """Identity of a source image's pixels, to encode each distinct image once per call."""
    if is_fake(image):
        # A fake tensor (``python -m unirl_pl plan`` traces on them) has a shape and no pixels: each is its own image.
        return tuple(image.shape), f"fake {id(image)}"
    data = image.detach().float().contiguous().cpu().numpy().tobytes()
    return tuple(image.shape), hashlib.sha256(data).hexdigest()


class QwenImageEditPlusGenerator(QwenImageGenerator):
    """Qwen-Image-Edit-Plus from a ``QwenImageEditPlusPipeline`` folder (``Qwen/Qwen-Image-Edit-2509``,
    ``Qwen/Qwen-Image-Edit-2511`` and their fine-tunes); one source image per sample.

    Latents, packing, schedule (``mu`` of the *target's* token count, as the pipeline computes it), true CFG with
    the norm rescale (:meth:`guide`), decode and LoRA targets are Qwen-Image's (:class:`QwenImageGenerator`).

    Conditioning (``encode(texts, images)`` merged with ``encode_source(images)``):

    - ``hidden``/``mask`` (B, max_sequence_length, D): ``_get_qwen_prompt_embeds`` of the prompt with its source
      image, as ``encode_prompt`` computes it for one prompt: the pipeline's edit template around
      ``"Picture 1: <|vision_start|><|image_pad|><|vision_end|>" + prompt``, the image resized to the pipeline's
      condition size (``calculate_dimensions(384 * 384, aspect)``, PIL Lanczos) and given to the Qwen2.5-VL image
      processor, the pads expanded, the last hidden state past the template's 64 system tokens; zero-padded to the
      fixed width with a mask. Longer features are truncated to ``max_sequence_length`` (the pipeline keeps them
      whole; at the default 512 a 1024 px source's ~200 image tokens leave ~300 for the instruction).
    - ``source_latents`` (B, S, 4C): the source's VAE latents as ``prepare_latents`` makes them: the image resized
      (stretched, the pipeline's ``VaeImageProcessor.preprocess``) to ``source_size``, encoded
      to the posterior mode, normalised by ``latents_mean``/``latents_std`` and 2x2-packed.
    - ``source_negative_hidden``/``source_negative_mask`` (with ``negative_sees_source``): the empty prompt's
      features *with* the source image, which is what the pipeline's negative branch encodes
      (``encode_prompt(image=condition_images, prompt=negative_prompt)``), and ``empty_prompt`` (B, 1): 1 on the rows
      of the empty prompt encoded without an image (``encode([""])``, the loop's one-row unconditional branch).
      ``DiffusionDenoise.velocity`` fills the source keys of the unconditional rows from the conditional ones, so the
      DiT sees each sample's own image-conditioned negative there, as the pipeline's true CFG does.

    Args:
        pipeline_path: Local ``QwenImageEditPlusPipeline`` folder (with its ``processor/`` folder).
        source_size: ``(height, width)`` in pixels each source image is resized (stretched) to before VAE encoding,
            multiples of 16 at real scale (the VAE factor times the 2x2 packing); ``None`` means the sample's
            ``height`` x ``width``. The pipeline encodes each source at ``calculate_dimensions(1024 * 1024, aspect)``
            and, when the output size is left to it, makes the output that same size; a batch needs one source shape
            for all samples, so here it is fixed. The default is the pipeline's own choice for a source of the
            target's aspect and size; ``[1024, 1024]`` matches a pipeline call that asks for a smaller output than
            its 1024 px square sources (more source tokens: 4096 with 1024 target tokens at 512 px).
        negative_sees_source: Give the unconditional (true CFG) branch the empty prompt's features with the source
            image, as the pipeline does (one more text-encoder pass and one more feature row per source image).
            ``False`` keeps the empty prompt's features without the image there: cheaper, and a deviation from the
            pipeline's guidance.
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512, at most 1024).
    """

    family = "qwenimage_edit_plus"
    pipeline_class = QwenImageEditPlusPipeline
    takes_source_images = True
    text_sees_source = True

    def __init__(
        self,
        pipeline_path: str | None = None,
        source_size: tuple[int, int] | None = None,
        negative_sees_source: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(pipeline_path, **kwargs)
        size = (self.height, self.width) if source_size is None else tuple(int(side) for side in source_size)
        if len(size) != 2:
            raise ValueError(f"source_size must be [height, width], got {list(size)}")
        check_positive(source_height=size[0], source_width=size[1])
        self.source_size: tuple[int, int] = size
        self.negative_sees_source = negative_sees_source

    def _check_index(self, index: dict[str, Any]) -> None:
        super()._check_index(index)
        config = Path(self._folder()) / "processor" / "preprocessor_config.json"
        if not config.is_file():
            raise FileNotFoundError(
                f"{str(config)!r} is missing: a QwenImageEditPlusPipeline folder needs its processor folder (the "
                "Qwen2.5-VL image processor the text encoder reads the source image through)"
            )

    # ------------------------------------------------------------------ geometry

    def _compute_latent_shape(self) -> tuple[int, ...]:
        shape = super()._compute_latent_shape()
        multiple = 2 * self.vae_scale_factor()
        for name, side in zip(("height", "width"), self.source_size, strict=True):
            if side % multiple:
                raise ValueError(
                    f"source_size {name} ({side}) must be a multiple of {multiple} pixels for this {self.family} "
                    "pipeline"
                )
        return shape

    @property
    def source_latent_size(self) -> tuple[int, int]:
        """(rows, columns) of a source image's latents before packing."""
        factor = self.vae_scale_factor()
        self.latent_shape  # noqa: B018 - validates the source size
        return self.source_size[0] // factor, self.source_size[1] // factor

    # ------------------------------------------------------------------ components

    def _load_text(self, index: dict[str, Any]) -> None:
        # The pipeline reads prompts through its processor (the processor folder's tokenizer and image processor);
        # its ``tokenizer`` component is not used for encoding. A processor folder without tokenizer files falls back
        # to ``tokenizer/`` (the same Qwen2.5-VL tokenizer in the published folders).
        processor = Path(self._folder()) / "processor"
        self.tokenizer = self._load_tokenizer(
            "processor" if (processor / "tokenizer_config.json").is_file() else "tokenizer"
        )
        self._load_processors()
        self.text_encoder = self._load_frozen(Qwen2_5_VLForConditionalGeneration, "text_encoder")

    def _load_processors(self) -> None:
        """The parts without weights (``plan`` builds them too): the processor folder's Qwen2.5-VL image processor
        and the pipeline's own ``image_processor`` (PIL resizes for the condition image and the VAE image)."""
        self.image_processor = AutoImageProcessor.from_pretrained(self.pipeline_path, subfolder="processor")
        self.vae_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor() * 2)

    def condition_image(self, image: Tensor) -> PIL.Image.Image:
        """The source as the text encoder's image: resized to the pipeline's condition size for its aspect
        (``calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)``) by the pipeline's
        ``image_processor.resize``."""
        pil = to_pil(image)
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, pil.width / pil.height)
        return self.vae_processor.resize(pil, height, width)

    def text_inputs(self, text: str, image: Tensor | None = None) -> dict[str, Tensor]:
        """What ``QwenImageEditPlusPipeline._get_qwen_prompt_embeds`` gives its text encoder for one prompt (and its
        source image): ``input_ids``, ``attention_mask`` and, with an image, ``pixel_values`` and ``image_grid_thw``
        from the image processor, the pad expanded to the image's merged token count as ``Qwen2VLProcessor`` does."""
        if image is not None and is_fake(image):
            return self._shaped_text_inputs(image)
        prompt = EDIT_PROMPT_TEMPLATE.format(("" if image is None else IMAGE_PROMPT.format(1)) + text)
        inputs: dict[str, Tensor] = {}
        if image is not None:
            vision = self.image_processor(images=[self.condition_image(image)], return_tensors="pt")
            inputs = {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}
            count = int(vision["image_grid_thw"][0].prod()) // self.image_processor.merge_size**2
            prompt = prompt.replace(IMAGE_PAD, IMAGE_PAD * count, 1)
        tokens = self.tokenizer([prompt], return_tensors="pt")
        inputs = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask, **inputs}
        return {key: value.to(self.text_encoder.device) for key, value in inputs.items()}

    def _shaped_text_inputs(self, image: Tensor) -> dict[str, Tensor]:
        """:meth:`text_inputs` for a source that has a shape and no pixels (a fake tensor: ``python -m unirl_pl
        plan`` traces a step's memory on them; no PIL image, no tokenizer): the image processor's output for the
        condition image of that source's aspect, sized by its own ``smart_resize`` rule (float32 patches of the
        grid, and the grid), and the ids of the longest prompt whose features are kept, the template's leading
        tokens and ``max_sequence_length`` more (at least the image's pads and one token), holding the grid's count
        of image pads. The ids and the grid are Python values, which the plan's ``AllRowsReal`` carries: the
        Qwen2.5-VL forward reads them (the pads' count check, the vision windows, the features' split per image)."""
        processor = self.image_processor
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.shape[-1] / image.shape[-2])
        patch, merge = processor.patch_size, processor.merge_size
        size = processor.size
        height, width = smart_resize(height, width, patch * merge, size.shortest_edge, size.longest_edge)
        grid = (1, height // patch, width // patch)
        pads = grid[1] * grid[2] // merge**2
        length = EDIT_TEMPLATE_TOKENS + max(self.max_sequence_length, pads + 1)
        ids = [0] * length
        ids[EDIT_TEMPLATE_TOKENS : EDIT_TEMPLATE_TOKENS + pads] = [self.text_encoder.config.image_token_id] * pads
        patches = grid[0] * grid[1] * grid[2]
        inputs = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.tensor([[1] * length]),
            "pixel_values": torch.empty(patches, 3 * processor.temporal_patch_size * patch**2),
            "image_grid_thw": torch.tensor([grid]),
        }
        return {key: value.to(self.text_encoder.device) for key, value in inputs.items()}

    def prompt_features(self, text: str, image: Tensor | None = None) -> Tensor:
        """The pipeline's ``_get_qwen_prompt_embeds`` of ``text`` alone (with ``image``, a (3, H, W) source in
        [0, 1]): (tokens, D) in the text encoder's dtype, truncated to ``max_sequence_length``."""
        out = self.text_encoder(**self.text_inputs(text, image), output_hidden_states=True)
        return out.hidden_states[-1][0, EDIT_TEMPLATE_TOKENS:][: self.max_sequence_length]

    def _padded(self, states: Tensor) -> tuple[Tensor, Tensor]:
        """Features (tokens, D) zero-padded to ``max_sequence_length``, and their mask."""
        pad = self.max_sequence_length - states.shape[0]
        mask = torch.cat([states.new_ones(states.shape[0]), states.new_zeros(pad)])
        return torch.cat([states, states.new_zeros(pad, states.shape[1])]), mask

    def _rows(self, keys: list[Any], features: dict[Any, Tensor]) -> tuple[Tensor, Tensor]:
        padded = {key: self._padded(states) for key, states in features.items()}
        return torch.stack([padded[k][0] for k in keys]), torch.stack([padded[k][1] for k in keys])

    def _encode(self, texts: list[str]) -> Cond:
        # Without an image: the empty prompt of the loop's unconditional branch (marked, see the class docstring).
        hidden, mask = self._rows(texts, {text: self.prompt_features(text) for text in dict.fromkeys(texts)})
        empty = torch.tensor([[float(text == "")] for text in texts], device=hidden.device)
        return {"hidden": hidden, "mask": mask, EMPTY_PROMPT: empty}

    def _encode_with_images(self, texts: list[str], images: list[Tensor]) -> Cond:
        keys = [(text, _image_key(image)) for text, image in zip(texts, images, strict=True)]
        features = {}
        for key, text, image in zip(keys, texts, images, strict=True):
            if key not in features:
                features[key] = self.prompt_features(text, image)
        hidden, mask = self._rows(keys, features)
        return {"hidden": hidden, "mask": mask, EMPTY_PROMPT: hidden.new_zeros(len(texts), 1)}

    def source_tokens(self, image: Tensor) -> Tensor:
        """One source image's packed VAE latents (S, 4C), as ``QwenImageEditPlusPipeline.prepare_latents`` makes
        them from ``image_processor.preprocess(image, *source_size)``: the posterior mode
        (``_encode_vae_image``), ``(z - latents_mean) / latents_std``, 2x2-packed."""
        vae = self.vae
        if is_fake(image):  # shapes only (``plan``): the preprocessed size, no pixels to resize
            pixels = torch.empty(1, 3, 1, *self.source_size)
        else:
            pixels = self.vae_processor.preprocess(to_pil(image), *self.source_size).unsqueeze(2)
        latents = retrieve_latents(vae.encode(pixels.to(vae.device, vae.dtype)), sample_mode="argmax")
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return _pack(((latents - mean) / std)[:, :, 0])[0]

    def _encode_source(self, images: list[Tensor]) -> Cond:
        keys = [_image_key(image) for image in images]
        latents: dict[Any, Tensor] = {}
        negative: dict[Any, Tensor] = {}
        for key, image in zip(keys, images, strict=True):
            if key in latents:
                continue
            latents[key] = self.source_tokens(image)
            if self.negative_sees_source:
                negative[key] = self.prompt_features("", image)
        cond = {SOURCE_LATENTS: torch.stack([latents[k] for k in keys])}
        if self.negative_sees_source:
            cond[NEGATIVE_HIDDEN], cond[NEGATIVE_MASK] = self._rows(keys, negative)
        return cond

    # ------------------------------------------------------------------ the DiT

    def img_shapes(self, batch: int) -> list[list[tuple[int, int, int]]]:
        """The pipeline's ``img_shapes``: per sample, the target's packed grid then the source's."""
        _, height, width = self.latent_shape
        rows, columns = self.source_latent_size
        return [[(1, height // 2, width // 2), (1, rows // 2, columns // 2)]] * batch

    def _forward(self, transformer: Any, latents: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        batch, _, height, width = latents.shape
        source = cond.get(SOURCE_LATENTS)
        rows, columns = self.source_latent_size
        expected = (rows // 2) * (columns // 2)
        if source is None or source.ndim != 3 or source.shape[1] != expected:
            got = "none" if source is None else tuple(source.shape)
            size = "x".join(map(str, self.source_size))
            raise ValueError(
                f"{type(self).__name__} needs each sample's source latents (cond[{SOURCE_LATENTS!r}] from "
                f"encode_source, (B, {expected}, C) for a {size} source), got {got}"
            )
        hidden, mask = cond["hidden"], cond["mask"]
        if NEGATIVE_HIDDEN in cond and EMPTY_PROMPT in cond:
            # The unconditional rows: the empty prompt read with this sample's source, as the pipeline's negative.
            empty = cond[EMPTY_PROMPT].reshape(batch) > 0.5
            hidden = torch.where(empty.view(batch, 1, 1), cond[NEGATIVE_HIDDEN], hidden)
            mask = torch.where(empty.view(batch, 1), cond[NEGATIVE_MASK], mask)
        target = (height // 2) * (width // 2)
        velocity = transformer(
            hidden_states=torch.cat([_pack(latents), source], dim=1),
            timestep=sigma,
            guidance=None,
            encoder_hidden_states=hidden,
            encoder_hidden_states_mask=mask,
            img_shapes=self.img_shapes(batch),
            return_dict=False,
        )[0]
        return _unpack(velocity[:, :target], height, width)
