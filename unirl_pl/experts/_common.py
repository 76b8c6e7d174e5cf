"""Helpers shared by the expert wrappers: dtype names, seeded construction, freezing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name from a recipe (``float32``, ``bfloat16``, ``float16`` or ``fp32``/``bf16``/``fp16``)
    to a ``torch.dtype``, raising ``ValueError`` that lists the accepted names for anything else."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def check_positive(**values: int | float) -> None:
    """Raise ``ValueError`` naming the first argument whose value is not strictly positive."""
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def check_divisible(**values: int) -> None:
    """Raise ``ValueError`` unless the first named value is divisible by the second (e.g. width by heads)."""
    (big_name, big), (small_name, small) = values.items()
    if big % small:
        raise ValueError(f"{big_name} ({big}) must be divisible by {small_name} ({small})")


@contextmanager
def seeded_cpu_init(seed: int) -> Iterator[None]:
    """Build modules on CPU in float32 from a fixed seed without disturbing any global state.

    Random init must give the same weights on every rank and device, and must not shift the caller's
    RNG stream (the trainer's sampling seeds depend on it). So the CPU generator is forked and seeded
    (CUDA generators are never touched because only the CPU one is seeded), construction is pinned to
    CPU even inside a ``torch.device("meta"/"cuda")`` context (e.g. Lightning's ``configure_model``),
    and the default dtype is float32 even under a bf16 init context. Callers cast and move afterwards.
    """
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.random.default_generator.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def freeze(module: torch.nn.Module) -> torch.nn.Module:
    """Turn off gradients for every parameter of ``module`` and put it in eval mode; returns it."""
    module.requires_grad_(False)
    module.eval()
    return module
