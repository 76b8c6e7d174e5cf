"""Builders of tiny random diffusers *editing* pipeline folders for tests, made offline with the real classes.

As :mod:`tests.pipelines`: each ``make_*_pipeline(path)`` assembles the family's real diffusers pipeline from tiny
randomly initialised components (from a fixed seed, without disturbing the caller's RNG) and ``save_pretrained``s
it, so the folder has the hub checkpoint's layout and ``model_index.json``. FLUX.2 [klein] edits with the folder of
:func:`tests.pipelines.make_flux2_klein_pipeline` (its pipeline takes the reference image itself).
"""

from __future__ import annotations

from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

from tests.pipelines import FLUX_DEV_SCHEDULER, flux_components


def make_flux_kontext_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``FluxKontextPipeline`` and return it: :func:`tests.pipelines.flux_components`
    (CLIP width 16, T5 width 32, a 2x VAE with 4 channels and a non-trivial scale and shift, a FLUX DiT with one
    double and one single block and the guidance embedding of FLUX.1 Kontext [dev]) and FLUX.1-dev's dynamically
    shifting scheduler (the one Kontext ships), so the schedule's ``mu`` follows the target's token count."""
    scheduler = {k: v for k, v in FLUX_DEV_SCHEDULER.items() if k != "_class_name"}
    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), **flux_components(guidance_embeds=True, seed=seed)
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
