"""Loading a saved LoRA adapter back into a model's peft adapter, in place, with one check for every expert.

The refiner reads peft's own format (``load_peft_weights``), the generators and the DiT read the diffusers
pipelines' ``save_lora_weights`` file (:data:`LORA_WEIGHTS_FILE`, keys prefixed by the pipeline's component
name); both end in :func:`load_lora_weights`, so an adapter saved for another model is refused the same way
(and with the same message) wherever it is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"
"""The file diffusers' ``load_lora_weights`` looks for in a folder: every exported adapter is written under it."""


def load_lora_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """Copy ``weights`` (peft adapter keys, as ``get_peft_model_state_dict`` gives them) into ``model``'s adapter.

    Raises ``ValueError`` naming ``source`` unless they fill the adapter exactly: no tensor at all, a LoRA
    tensor of the adapter that ``weights`` lack (another rank or other target modules), or a tensor the
    adapter has no place for (another model) are refused. The base weights are never in an adapter file, so
    only LoRA keys count as missing.
    """
    result = set_peft_model_state_dict(model, dict(weights))
    missing = sorted(key for key in result.missing_keys if "lora_" in key)
    unexpected = sorted(result.unexpected_keys)
    if not weights or missing or unexpected:
        raise ValueError(
            f"adapter at {str(source)!r} does not match this model's adapter: {len(weights)} tensors, "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def read_lora_file(path: str | Path, prefix: str, device: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``save_lora_weights`` file (``path`` itself, or :data:`LORA_WEIGHTS_FILE` in the folder
    ``path``) whose keys start with ``prefix.``, that prefix removed (peft's keys), on ``device``."""
    file = Path(path)
    file = file / LORA_WEIGHTS_FILE if file.is_dir() else file
    start = f"{prefix}."
    return {k.removeprefix(start): v for k, v in load_file(str(file), device=device).items() if k.startswith(start)}


def load_lora_file(model: torch.nn.Module, path: str | Path, prefix: str) -> None:
    """:func:`load_lora_weights` of the ``prefix`` component's tensors in a ``save_lora_weights`` file or folder,
    read onto the device of ``model``'s parameters."""
    device = str(next(model.parameters()).device)
    load_lora_weights(model, read_lora_file(path, prefix, device), path)
