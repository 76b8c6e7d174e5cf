"""Flow-matching generators behind one interface: ``latent_shape``, ``encode(texts) -> Cond``,
``velocity(latents, sigma, cond)``, ``decode(latents)``, ``adapter_disabled()`` and the trainable
``expert``. ``ComponentGenerator`` assembles the project's own configured parts; the families load
from diffusers pipeline folders (``FlowGenerator``): SD3 / SD3.5, FLUX.1 dev and schnell, FLUX.2 [klein],
Wan2.1 / Wan2.2 text-to-video, Z-Image and Z-Image-Turbo, Qwen-Image; the editing families (a source image
per sample, ``encode_source``) FLUX.1 Kontext, FLUX.2 [klein] with a reference image and Qwen-Image-Edit-Plus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl_pl.generators.base import Cond, FlowGenerator
from unirl_pl.generators.components import ComponentGenerator, pixels_to_images
from unirl_pl.generators.flux import FluxGenerator
from unirl_pl.generators.flux2 import Flux2KleinGenerator
from unirl_pl.generators.flux_kontext import FluxKontextGenerator
from unirl_pl.generators.folder import read_model_index
from unirl_pl.generators.in_context import InContextEditGenerator
from unirl_pl.generators.qwenimage import QwenImageGenerator
from unirl_pl.generators.qwenimage_edit import QwenImageEditPlusGenerator
from unirl_pl.generators.sd3 import SD3Generator
from unirl_pl.generators.wan import WanGenerator
from unirl_pl.generators.zimage import ZImageGenerator

GENERATORS: dict[str, type[FlowGenerator]] = {
    cls.pipeline_class.__name__: cls
    for cls in (
        SD3Generator,
        FluxGenerator,
        FluxKontextGenerator,
        Flux2KleinGenerator,
        WanGenerator,
        ZImageGenerator,
        QwenImageGenerator,
        QwenImageEditPlusGenerator,
    )
}
"""Generator class per diffusers pipeline class name (``model_index.json`` ``_class_name``)."""


def load_generator(pipeline_path: str | Path, **kwargs: Any) -> FlowGenerator:
    """Create (not yet ``build()``) the generator for a local diffusers pipeline folder, picked by the
    ``_class_name`` of its ``model_index.json``; ``kwargs`` go to the generator's constructor.

    Raises ``FileNotFoundError`` when the folder or its ``model_index.json`` is missing and
    ``ValueError`` listing the supported pipeline classes for any other pipeline.
    """
    name = read_model_index(pipeline_path).get("_class_name")
    if name not in GENERATORS:
        raise ValueError(
            f"{str(pipeline_path)!r} holds a {name!r} pipeline, which no generator supports; "
            f"supported pipeline classes: {', '.join(sorted(GENERATORS))}"
        )
    return GENERATORS[name](str(pipeline_path), **kwargs)


__all__ = [
    "GENERATORS",
    "ComponentGenerator",
    "Cond",
    "FlowGenerator",
    "Flux2KleinGenerator",
    "FluxGenerator",
    "FluxKontextGenerator",
    "InContextEditGenerator",
    "QwenImageEditPlusGenerator",
    "QwenImageGenerator",
    "SD3Generator",
    "WanGenerator",
    "ZImageGenerator",
    "load_generator",
    "pixels_to_images",
]
