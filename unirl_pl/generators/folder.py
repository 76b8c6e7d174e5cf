"""A local diffusers pipeline folder: its ``model_index.json`` and which components it declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl_pl.errors import InputError
from unirl_pl.paths import read_json_file


def read_model_index(pipeline_path: str | Path) -> dict[str, Any]:
    """Read ``model_index.json`` of a local diffusers pipeline folder, raising ``FileNotFoundError``
    that says what is missing when the folder or its index does not exist (nothing is downloaded)."""
    folder = Path(pipeline_path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"pipeline_path {str(pipeline_path)!r} is not a folder: pass a local diffusers pipeline folder "
            "(as written by DiffusionPipeline.save_pretrained or downloaded beforehand); nothing is downloaded"
        )
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no model_index.json, so it is not a diffusers pipeline folder "
            "(point pipeline_path at the folder that holds model_index.json, transformer/, vae/, ...)"
        )
    index_data = read_json_file(index)
    if not isinstance(index_data, dict):
        raise InputError(f"{index}: holds a JSON {type(index_data).__name__}, not the object a model_index.json is")
    return index_data


def has_component(index: dict[str, Any], name: str) -> bool:
    """Whether the pipeline index declares component ``name``; ``save_pretrained`` writes an absent
    optional component as ``[null, null]``."""
    entry = index.get(name)
    return isinstance(entry, list | tuple) and len(entry) == 2 and entry[0] is not None
