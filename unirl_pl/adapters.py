"""A module's trained adapters written in their libraries' own formats: ``llm/`` (peft) and ``transformer/``
(diffusers LoRA).

Both the ``AdapterExport`` callback (at the end of ``fit``) and the ``export`` command (from a checkpoint)
write adapters through :func:`export_adapters`. It lives below both, importing neither, so the callbacks
package does not import the command, and the command (which builds its module through :mod:`unirl_pl.cli`)
does not sit on an import cycle with the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl_pl.card import Role

# Expert role -> its folder under the output directory (named as the role's component, as always).
ADAPTER_DIRS = {Role.REFINER: Role.REFINER, Role.GENERATOR: Role.GENERATOR}
# Expert role -> the folder of a fully fine-tuned expert's whole model (``finetune: full``): the refiner as a
# ``transformers`` folder, the generator as a diffusers pipeline folder (a family) or model folder (the
# project's component generator).
FULL_MODEL_DIRS = {Role.REFINER: "refiner", Role.GENERATOR: "generator"}


def export_adapters(module: Any, out_dir: str | Path) -> dict[str, Path]:
    """Write every built expert of ``module`` (a ``UniRLModule``) under ``out_dir``; return the paths.

    A LoRA expert is written as its adapter (``ADAPTER_DIRS``), a fully fine-tuned one as its whole model
    (``FULL_MODEL_DIRS``). Both experts are written even when the mode froze one, so a folder is always a
    complete policy.
    """
    out = Path(out_dir)
    written = {}
    for name, sub in ADAPTER_DIRS.items():
        expert = module.experts().get(name)
        if expert is None or not expert.is_built:
            continue
        full = getattr(expert, "finetune", "lora") == "full"
        path = out / (FULL_MODEL_DIRS[name] if full else sub)
        path.mkdir(parents=True, exist_ok=True)
        (expert.save_model if full else expert.save_adapter)(str(path))
        written[name] = path
    return written
