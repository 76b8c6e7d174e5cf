"""Builders of tiny random diffusers *editing* pipeline folders for tests, made offline with the real classes.

As :mod:`tests.pipelines`: each ``make_*_pipeline(path)`` assembles the family's real diffusers pipeline from tiny
randomly initialised components (from a fixed seed, without disturbing the caller's RNG) and ``save_pretrained``s
it, so the folder has the hub checkpoint's layout and ``model_index.json``. FLUX.2 [klein] edits with the folder of
:func:`tests.pipelines.make_flux2_klein_pipeline` (its pipeline takes the reference image itself).
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
from transformers import T5Config, T5EncoderModel

from tests.pipelines import FLUX_DEV_SCHEDULER, _clip, _image_vae, _t5_config, clip_tokenizer, t5_tokenizer
from unirl_pl.experts._common import seeded_cpu_init


def make_flux_kontext_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``FluxKontextPipeline`` and return it: the parts of :func:`tests.pipelines.make_flux_pipeline`
    (CLIP width 16, T5 width 32, a 2x VAE with 4 channels and a non-trivial scale and shift, a FLUX DiT with one
    double and one single block and the guidance embedding of FLUX.1 Kontext [dev]) and FLUX.1-dev's dynamically
    shifting scheduler (the one Kontext ships), so the schedule's ``mu`` follows the target's token count."""
    with seeded_cpu_init(seed):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * 4,  # 2x2-packed 4-channel latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=16,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
        t5 = T5EncoderModel(_t5_config(T5Config, 32)).eval()
    scheduler = {k: v for k, v in FLUX_DEV_SCHEDULER.items() if k != "_class_name"}
    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        vae=_image_vae(seed + 1),
        text_encoder=_clip(16, False, seed + 2),
        tokenizer=clip_tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(str(path))
    return Path(path)


if __name__ == "__main__":
    # python -m tests.pipelines_edit flux_kontext FOLDER: a tiny random Kontext folder for CPU runs.
    import sys

    builders = {"flux_kontext": make_flux_kontext_pipeline}
    if len(sys.argv) != 3 or sys.argv[1] not in builders:
        sys.exit(f"usage: python -m tests.pipelines_edit {{{','.join(builders)}}} FOLDER")
    print(builders[sys.argv[1]](sys.argv[2]))
